"""Context parallelism: the positions of every sequence split over a cp group, ring attention.

Split (load-balanced for causal attention): the T positions of a sequence are cut into 2*cp
chunks of c = T / (2*cp); cp rank i holds chunk i and chunk 2*cp-1-i, in that order, so every
rank gets one early and one late chunk and causal attention costs every rank the same. All
position-wise modules (embedding with the positions of its chunks, LayerNorm, MLP, MoE, head)
run on these 2c local positions unchanged; only attention needs the others' keys and values.

Ring attention (``RingAttentionCore``, the attention core of nn.attention_core with the same
interface): rank i's key/value block travels around the cp ring, one hop per step, the next
block's transfer (nonblocking send/recv) overlapping the computation of the block in hand. For
the block of rank j, causality leaves exactly one of three cases:

    j == i   causal attention of the local sequence (its two chunks are in position order)
    j <  i   every local query sees the first chunk of j (chunk j < i), not its second
    j >  i   only the second local chunk (2cp-1-i) sees j's keys, both its chunks

Each block gives (o_b, lse_b) from the tiled kernel (kernels.attention_block_forward); the
blocks merge with the online softmax's log-sum-exp: lse = logaddexp(lse, lse_b),
o = o e^(lse_old - lse) + o_b e^(lse_b - lse). The backward sends the key/value blocks around
again; the dK, dV a rank computes for another's block (only the key rows its queries see) go
straight to the block's owner, which adds them to its own block's in the ring's order. The block
backward uses the merged o and lse, so the blocks' gradients sum to the full softmax's.

Loss and gradients: every rank's cross-entropy is the mean over its local positions (equal
counts on every rank by the split), so the mean over the cp group is the micro-batch's mean; the
gradient sync averages replicated gradients over dp x cp (Mesh.dpcp_comm). MoE layers add the
routing counts over cp (their auxiliary loss uses the micro-batch's expert fractions) and, when
a capacity drops assignments, decide the drops in the micro-batch's own priority order
(``CPRouting``), so cp changes no number (docs/design.md, Determinism).
"""
from __future__ import annotations

import functools
import time

import numpy as np

from .. import kernels
from ..backend import xp_of
from ..nn.attention_core import AttentionModule, CausalAttentionCore
from ..nn.layers import TokenEmbedding
from .meter import Meter

_KV_TAG, _DKV_TAG = 0x6370, 0x6371          # ring messages (tags apart from the pipeline's)


CP_COMMS = ("ring", "a2a", "a2a+ring")


def a2a_group_sizes(cp: int, heads: int) -> list:
    """The Ulysses group sizes --cp-comm a2a+ring can use: divisors of cp strictly between 1 and cp
    that also divide ``heads`` (a tp rank's)."""
    return [d for d in range(2, cp) if cp % d == 0 and heads % d == 0]


def validate_cp(model_cfg, cp: int, tp: int = 1, seq_parallel: bool = False, seq_len: int | None = None,
                comm: str = "ring", a2a: int = 0) -> None:
    """Raise ValueError unless the model's sequences split into 2*cp equal chunks (no communication),
    and, for Ulysses (comm 'a2a'), unless each tp rank's heads split over cp; for 'a2a+ring'
    (Ulysses inside groups of ``a2a`` consecutive cp ranks, the ring across the groups), unless
    1 < a2a < cp, a2a divides cp and each tp rank's heads split over a2a."""
    if comm not in CP_COMMS:
        raise ValueError(f"--cp-comm {comm!r}: expected one of {', '.join(CP_COMMS)}")
    if comm != "a2a+ring" and a2a:
        raise ValueError(f"--cp-a2a {a2a} sizes the Ulysses groups of --cp-comm a2a+ring, but --cp-comm is {comm}")
    heads = model_cfg.n_head // tp
    if cp == 1:
        if comm == "a2a+ring":
            raise ValueError("--cp-comm a2a+ring runs Ulysses inside groups of --cp-a2a ranks and the ring across "
                             "them: it needs --cp 4 or more with a divisor between 1 and cp (e.g. --cp 4 --cp-a2a 2)")
        if comm == "a2a":
            raise ValueError("--cp-comm a2a splits the heads over the cp ranks: it needs --cp 2 or more")
        return
    if comm == "a2a+ring":
        ok = a2a_group_sizes(cp, heads)
        if a2a not in ok:
            raise ValueError(f"--cp-comm a2a+ring runs Ulysses inside groups of --cp-a2a ranks and the ring across "
                             f"them: --cp-a2a must divide cp={cp} and the {heads} head(s) of a tp rank and lie strictly "
                             f"between 1 and cp, got {a2a}"
                             + (f" (use one of {ok})" if ok else " (none does here: use --cp-comm ring"
                                + (" or a2a)" if heads % cp == 0 else ")")))
    if comm == "a2a" and heads % cp:
        raise ValueError(f"--cp-comm a2a gives each of the cp={cp} ranks n_head/(tp*cp) heads of whole sequences, "
                         f"but this tp rank has {heads} heads (n_head={model_cfg.n_head}, tp={tp}): use a cp that "
                         f"divides {heads}, or --cp-comm ring")
    T = seq_len or model_cfg.block_size
    if T < 2 * cp or T % (2 * cp):
        ok = [d for d in range(2, T + 1) if T % (2 * d) == 0][:6]
        raise ValueError(f"cp={cp} needs a sequence length divisible by 2*cp = {2 * cp} (each rank takes two of "
                         f"2*cp equal chunks, for equal causal work); block_size={T}: use "
                         + (f"cp in {ok}" if ok else "cp=1 (this sequence is too short to split)")
                         + f" or a block_size that is a multiple of {2 * cp}")
    if seq_parallel and (T // cp) % tp:
        raise ValueError(f"--seq-parallel with cp={cp} splits each rank's {T // cp} positions over tp={tp}: "
                         f"block_size / cp must be divisible by tp")


def chunks(T: int, cp: int, rank: int) -> tuple:
    """The two chunks of global positions cp rank ``rank`` holds, as slices: chunk rank, then chunk
    2cp-1-rank (of c = T / 2cp positions each)."""
    c = T // (2 * cp)
    return slice(rank * c, (rank + 1) * c), slice((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)


def positions(T: int, cp: int, rank: int) -> np.ndarray:
    """The global positions cp rank ``rank`` holds, in local order: its two chunks()."""
    if cp == 1:
        return np.arange(T)
    return np.concatenate([np.arange(s.start, s.stop) for s in chunks(T, cp, rank)])


def local_batch(batch, pos):
    """(idx, targets) of full sequences -> the positions ``pos`` of each (host arrays stay host)."""
    idx, targets = batch
    return idx[:, pos], targets[:, pos]


def _block(i, j, T):
    """(query rows, key rows, causal) of rank i's block of rank j's keys, as slices of the T = 2c
    rows each rank holds: j == i causal on all; j < i all queries against j's first chunk; j > i
    the second chunk's queries against all of j's."""
    c = T // 2
    if j == i:
        return slice(0, T), slice(0, T), True
    if j < i:
        return slice(0, T), slice(0, c), False
    return slice(c, T), slice(0, T), False


@functools.lru_cache(maxsize=None)
def ring_buffer_blocks(cp: int) -> float:
    """The most key/value blocks' worth of buffers (B x 2c x 2 x C) a rank of RingAttentionCore
    holds at once, over the ranks (the ledger's communication): in the forward the block in hand
    and the next; in the backward also the dq scratch of the other blocks' rows (half a block),
    the partial being computed, the one sent the step before and the one arriving from it, then
    the one arriving from this step -- a partial is a whole block for a later rank's block and half
    of one for an earlier rank's (the key rows seen)."""
    if cp <= 1:
        return 0.0

    def part(i, j):                                      # rank i's partial of block j, in blocks (T = 2)
        kr = _block(i, j, 2)[1]
        return (kr.stop - kr.start) / 2
    most = 2.5                                           # backward step 0: the block, the next, the scratch
    for i in range(cp):
        for s in range(1, cp):
            held = 1.5 + (s < cp - 1) + part(i, (i - s) % cp)   # the block, scratch, the next, this partial
            before = part(i, (i - s + 1) % cp) + part((i + s - 1) % cp, i) if s > 1 else 0.0
            most = max(most, held + before, held + part((i + s) % cp, i))
    return most


class RingAttentionCore(CausalAttentionCore):
    """Causal attention of this rank's 2c positions against all T over the cp ring.

    Same face as CausalAttentionCore: forward(qkv (B, 2c, 3, nh, hs)) -> (ya (B, 2c, nh*hs), ctx),
    backward(dya, ctx) -> dqkv. The meter (pympar.parallel.meter) gets the seconds spent waiting
    for the ring's transfers ("cp wait") and the seconds of block computation ("cp compute")."""

    def __init__(self, cp_comm, meter: Meter | None = None):
        self.comm = cp_comm
        self.cp, self.rank = cp_comm.size, cp_comm.rank
        self.meter = Meter() if meter is None else meter
        self.peak_bytes = 0                      # the ring's buffers at their most (the ledger's communication)

    # --- the three block cases ------------------------------------------------------------
    def _block(self, j, T, i=None):
        """(query rows, key rows, causal) of rank i's block of rank j's keys (i: this rank), as slices
        of the 2c rows each holds."""
        return _block(self.rank if i is None else i, j, T)

    def _exchange(self, buf, tag):
        """Send buf to the next rank of the ring, receive the previous rank's into a new buffer."""
        xp = xp_of(buf)
        nxt = xp.empty_like(buf)
        n, p = (self.rank + 1) % self.cp, (self.rank - 1) % self.cp
        return nxt, (self.comm.isend(buf, n, tag=tag), self.comm.irecv(nxt, p, tag=tag))

    def _wait(self, reqs):
        t0 = time.perf_counter()
        for r in reqs:
            r.wait()
        self.meter.add("cp wait", time.perf_counter() - t0)

    @staticmethod
    def _poll(reqs):
        """Drive the transfers in flight: MPI moves a nonblocking message only inside MPI calls, so
        without these tests between the pieces of a block nothing would overlap."""
        for r in reqs:
            test = getattr(r, "test", None)
            if test is not None:
                test()

    @staticmethod
    def _head_groups(B, nh):
        """Heads in up to 4 groups: a block is computed group by group with the ring's transfers
        polled in between; each group keeps B x heads >= the kernel threads (the backward's faster
        split, csrc/attention.cpp)."""
        per = max(-(-kernels.get_num_threads() // B), -(-nh // 4), 1)
        return [(h, min(h + per, nh)) for h in range(0, nh, per)]

    def forward(self, qkv):                      # qkv (B, 2c, 3, nh, hs) -> ya (B, 2c, nh*hs), ctx
        B, T, three, nh, hs = qkv.shape
        if three != 3:
            raise ValueError(f"qkv has shape {qkv.shape}: expected (B, T, 3, n_head, head_size)")
        xp = xp_of(qkv)
        scale = 1.0 / np.sqrt(hs)
        kv = xp.ascontiguousarray(qkv[:, :, 1:])          # (B, 2c, 2, nh, hs): what travels
        self.peak_bytes = max(self.peak_bytes, 2 * kv.nbytes)
        q = qkv[:, :, 0]
        groups = self._head_groups(B, nh)
        o = lse = None
        for s in range(self.cp):
            j = (self.rank - s) % self.cp
            reqs = ()
            if s < self.cp - 1:
                nxt, reqs = self._exchange(kv, _KV_TAG)
            t0 = time.perf_counter()
            qr, kr, causal = self._block(j, T)
            for h0, h1 in groups:
                hd = slice(h0, h1)
                ob, lb = kernels.attention_block_forward(q[:, qr, hd], kv[:, kr, 0, hd], kv[:, kr, 1, hd], scale,
                                                         causal)
                if s > 0:
                    _merge(o, lse, ob, lb, qr, hd, hs)
                elif len(groups) == 1:                     # the local block covers every row
                    o, lse = ob, lb
                else:
                    if o is None:
                        o, lse = xp.empty((B, T, nh * hs), ob.dtype), xp.empty((B, nh, T), lb.dtype)
                    o[:, :, h0 * hs:h1 * hs], lse[:, hd] = ob, lb
                self._poll(reqs)
            self.meter.add("cp compute", time.perf_counter() - t0)
            if reqs:
                self._wait(reqs)
                kv = nxt
        return o, ("ring", qkv, o, lse)

    def backward(self, dya, ctx, consume=False):  # dya (B, 2c, nh*hs) -> dqkv (B, 2c, 3, nh, hs)
        """The keys and values travel the ring as in the forward; the gradients of a block's keys and
        values that another rank computes (its partial: only the key rows that rank's queries see)
        go straight to the block's owner, which adds them to its own block's in the ring's order
        (rank+1, rank+2, ...): the sums of one accumulator passed round the ring, in its order, at
        less traffic and with no zeroed buffers. (consume: accepted as the core's.)"""
        _, qkv, o, lse = ctx
        B, T, _, nh, hs = qkv.shape
        xp = xp_of(qkv)
        scale = 1.0 / np.sqrt(hs)
        dqkv = xp.empty_like(qkv)                          # s = 0 writes all of it: the own block's rows are all
        dq, dkv = dqkv[:, :, 0], dqkv[:, :, 1:]
        kv = xp.ascontiguousarray(qkv[:, :, 1:])
        q = qkv[:, :, 0]
        groups = self._head_groups(B, nh)
        scratch = xp.empty((B, T, nh, hs), qkv.dtype) if self.cp > 1 else None   # dq of the other blocks
        sent = got = None                  # the partial sent at the step before; the one arriving (buf, reqs, rows)
        for s in range(self.cp):
            j = (self.rank - s) % self.cp
            kv_reqs, nxt = (), None
            if s < self.cp - 1:
                nxt, kv_reqs = self._exchange(kv, _KV_TAG)
            t0 = time.perf_counter()
            qr, kr, causal = self._block(j, T)
            if s == 0:
                part, dqs = dkv, dq
            else:
                part = xp.empty((B, kr.stop - kr.start, 2, nh, hs), qkv.dtype)
                dqs = scratch[:, :qr.stop - qr.start]
            self._count(kv, nxt, scratch, part if s else None, sent and sent[0], got and got[0])
            busy = kv_reqs + (sent[1] if sent else ()) + (got[1] if got else ())
            for h0, h1 in groups:
                hd, cols = slice(h0, h1), slice(h0 * hs, h1 * hs)
                kernels.attention_block_backward(q[:, qr, hd], kv[:, kr, 0, hd], kv[:, kr, 1, hd], o[:, qr, cols],
                                                 lse[:, hd, qr], dya[:, qr, cols], scale, causal,
                                                 out=(dqs[:, :, hd], part[:, :, 0, hd], part[:, :, 1, hd]))
                self._poll(busy)
            busy = None                                     # (its requests hold the block sent before)
            if s > 0:
                dq[:, qr] += dqs
            self.meter.add("cp compute", time.perf_counter() - t0)
            self._settle(got, dkv)                          # the partial of rank + s - 1, in the ring's order
            if sent:
                self._wait(sent[1])
            sent = got = None
            if s > 0:                                       # this block's partial to its owner j
                sent = (part, (self.comm.isend(part, j, tag=_DKV_TAG),))
                src = (self.rank + s) % self.cp             # ... and the partial of this rank's block from rank + s
                rows = self._block(self.rank, T, i=src)[1]
                got = self._receive(xp, (B, rows.stop - rows.start, 2, nh, hs), qkv.dtype, src, rows)
                self._count(kv, nxt, scratch, part, got[0])
            part = dqs = None                               # a partial in flight is held by sent
            if kv_reqs:
                self._wait(kv_reqs)
                kv = nxt
        self._settle(got, dkv)
        if sent:
            self._wait(sent[1])
        return dqkv

    def _receive(self, xp, shape, dtype, src, rows):
        """(buffer, reqs, rows): a partial of this rank's keys and values, posted to arrive from src."""
        buf = xp.empty(shape, dtype)
        return buf, (self.comm.irecv(buf, src, tag=_DKV_TAG),), rows

    def _settle(self, got, dkv):
        """Wait for a partial of this rank's keys and values (buf, reqs, rows) and add it in."""
        if got:
            buf, reqs, rows = got
            self._wait(reqs)
            dkv[:, rows] += buf

    def _count(self, *bufs):
        """The ring's buffers alive together (None: absent) into peak_bytes."""
        self.peak_bytes = max(self.peak_bytes, sum(b.nbytes for b in bufs if b is not None))


class UlyssesAttentionCore(CausalAttentionCore):
    """DeepSpeed-Ulysses attention: one all-to-all turns this rank's 2c positions of every head into
    all T positions of nh/cp heads, the causal core (the one process's, unchanged) runs on whole
    sequences, and a second all-to-all turns the output back; the backward is the same two
    all-to-alls around the core's backward. A head's attention is then the one process's
    computation, so its numbers are too. Same face as CausalAttentionCore; the meter gets the
    all-to-alls' seconds ("cp wait") and the core's ("cp compute").

    ring_comm (a2a+ring, Megatron's a2a+p2p): cp_comm is then a group of u consecutive cp ranks and
    T the rows the group holds together; the ring of the groups (ring_comm, r = cp/u ranks)
    replaces the causal core. Group j's ranks hold chunks j*u+i and 2cp-1-j*u-i of the 2cp chunks:
    together chunk j and chunk 2r-1-j of 2r, the ring's own split, so member i's first chunk goes
    to rows [i c, (i+1) c) and its second to [T-(i+1) c, T-i c) (c = T/2u) -- the same rows as
    positions() gives a whole sequence when there is no ring."""

    def __init__(self, cp_comm, T: int, meter: Meter | None = None, ring_comm=None):
        self.comm = cp_comm
        self.cp, self.rank, self.T = cp_comm.size, cp_comm.rank, int(T)
        self.meter = Meter() if meter is None else meter
        self.chunks = [chunks(self.T, self.cp, r) for r in range(self.cp)]
        self.c = self.T // (2 * self.cp)
        self.ring = RingAttentionCore(ring_comm, self.meter) if ring_comm is not None else None
        self.peak_bytes = 0

    def _core_forward(self, full):
        if self.ring is not None:                # the ring meters its own waits and blocks
            got = self.ring.forward(full)
            self.peak_bytes = max(self.peak_bytes, self.ring.peak_bytes)
            return got
        t0 = time.perf_counter()
        got = super().forward(full)
        self.meter.add("cp compute", time.perf_counter() - t0)
        return got

    def _core_backward(self, dfull, inner):
        if self.ring is not None:                # held at the ring's peak: the received dfull, the
            got = self.ring.backward(dfull, inner, consume=True)      # ring's dqkv and its buffers
            self.peak_bytes = max(self.peak_bytes, dfull.nbytes + got.nbytes + self.ring.peak_bytes)
            return got
        t0 = time.perf_counter()
        got = super().backward(dfull, inner, consume=True)
        self.meter.add("cp compute", time.perf_counter() - t0)
        return got

    def _all_to_all(self, x):
        """x (cp, ...) contiguous, block r for rank r -> (cp, ...), block r from rank r."""
        t0 = time.perf_counter()
        got = self.comm.alltoall(x.reshape(self.cp, -1)).reshape(x.shape)
        self.meter.add("cp wait", time.perf_counter() - t0)
        self.peak_bytes = max(self.peak_bytes, 2 * x.nbytes)
        return got

    def _to_heads(self, a, nh):
        """a (B, 2c, ..., nh, hs) of this rank's positions -> (B, T, ..., nh/cp, hs): all positions,
        this rank's heads."""
        xp = xp_of(a)
        B, n = a.shape[:2]
        mid, hs, h = a.shape[2:-2], a.shape[-1], nh // self.cp
        send = xp.ascontiguousarray(xp.moveaxis(a.reshape(B, n, *mid, self.cp, h, hs), -3, 0))
        got = self._all_to_all(send)                        # (cp, B, 2c, ..., h, hs): rank r's positions
        del send
        full = xp.empty((B, self.T) + tuple(mid) + (h, hs), a.dtype)
        for r, (first, second) in enumerate(self.chunks):
            full[:, first] = got[r, :, :self.c]
            full[:, second] = got[r, :, self.c:]
        return full

    def _pack_positions(self, full):
        """(B, T, ..., nh/cp, hs) of this rank's heads -> the all-to-all's send buffer (cp, B, 2c, ...,
        nh/cp, hs): block r holds rank r's positions."""
        xp = xp_of(full)
        send = xp.empty((self.cp, full.shape[0], 2 * self.c) + full.shape[2:], full.dtype)
        for r, (first, second) in enumerate(self.chunks):
            send[r, :, :self.c] = full[:, first]
            send[r, :, self.c:] = full[:, second]
        return send

    @staticmethod
    def _from_heads(got, nh):
        """The all-to-all's received blocks (cp, B, 2c, ..., nh/cp, hs), block r rank r's heads of my
        positions -> (B, 2c, ..., nh, hs): this rank's positions, all heads."""
        xp = xp_of(got)
        B, n = got.shape[1:3]
        return xp.ascontiguousarray(xp.moveaxis(got, 0, -3)).reshape(B, n, *got.shape[3:-2], nh, got.shape[-1])

    def forward(self, qkv):                      # qkv (B, 2c, 3, nh, hs) -> ya (B, 2c, nh*hs), ctx
        B, n, three, nh, hs = qkv.shape
        if three != 3:
            raise ValueError(f"qkv has shape {qkv.shape}: expected (B, T, 3, n_head, head_size)")
        full = self._to_heads(qkv, nh)                      # (B, T, 3, nh/cp, hs)
        ya, ctx = self._core_forward(full)                   # (B, T, nh/cp * hs)
        out = self._from_heads(self._all_to_all(self._pack_positions(ya.reshape(B, self.T, nh // self.cp, hs))), nh)
        return out.reshape(B, n, nh * hs), ("ulysses", ctx, nh, hs)

    def backward(self, dya, ctx, consume=False):  # dya (B, 2c, nh*hs) -> dqkv (B, 2c, 3, nh, hs)
        _, inner, nh, hs = ctx
        B, n = dya.shape[:2]
        dfull = self._to_heads(dya.reshape(B, n, nh, hs), nh).reshape(B, self.T, (nh // self.cp) * hs)
        dqkv = self._core_backward(dfull, inner)             # (B, T, 3, nh/cp, hs)
        del dfull
        send = self._pack_positions(dqkv)
        del dqkv                                            # (the ring's own; else ctx's qkv, overwritten)
        got = self._all_to_all(send)
        del send
        return self._from_heads(got, nh)


def _merge(o, lse, ob, lb, rows, heads, hs):
    """Fold a block's (ob (B, r, h*hs), lb (B, h, r)) of the heads ``heads`` into (o, lse) on the
    query rows ``rows``: the online softmax's merge by log-sum-exp."""
    xp = xp_of(o)
    la = lse[:, heads, rows]
    new = xp.logaddexp(la, lb)                             # (B, h, r)
    wa = xp.exp(la - new).transpose(0, 2, 1)[..., None]    # (B, r, h, 1)
    wb = xp.exp(lb - new).transpose(0, 2, 1)[..., None]
    B, r = ob.shape[:2]
    h = wa.shape[2]
    cols = slice(heads.start * hs, heads.stop * hs)
    oa = o[:, rows, cols].reshape(B, r, h, hs)
    o[:, rows, cols] = (oa * wa + ob.reshape(B, r, h, hs) * wb).reshape(B, r, h * hs)
    lse[:, heads, rows] = new


class CPRouting:
    """MoE routing statistics of one micro-batch spread over the cp group (installed on MoE layers).

    counts(local_counts) -> the micro-batch's counts per expert (sum over cp);
    capacity_positions(a_expert, E, capacity) -> this rank's slot positions, decided over the whole
    micro-batch in its choice-major token order (the single process's priority)."""

    def __init__(self, cp_comm, pos, T):
        self.comm, self.pos, self.T = cp_comm, np.asarray(pos), int(T)

    def counts(self, local):
        out = self.comm.allreduce(local.copy())
        return local if out is None else out

    def capacity_positions(self, a_expert, E, capacity, k, B):
        """a_expert (k*B*2c,) local, choice-major -> (pos (k*B*2c,), counts (E,)) of the micro-batch."""
        xp = xp_of(a_expert)
        mine = a_expert.reshape(k, B, -1)
        parts = self.comm.allgather(xp.ascontiguousarray(mine))          # (cp*k, B, 2c), rank-major
        cp = self.comm.size
        full = xp.empty((k, B, self.T), dtype=a_expert.dtype)
        for r in range(cp):
            full[:, :, positions(self.T, cp, r)] = parts.reshape(cp, k, B, -1)[r]
        pos, counts = kernels.capacity_positions(full.reshape(-1), E, capacity)
        return pos.reshape(k, B, self.T)[:, :, self.pos].reshape(-1), counts


def install_context_parallel(model, cp_comm, T: int, meter: Meter | None = None, comm: str = "ring", a2a: int = 0):
    """Make ``model`` (nn.GPT, TPGPT or pipeline chunks: anything whose modules() reach its pieces)
    run this cp rank's positions of sequences of length T: ring attention (comm 'ring'),
    Ulysses' all-to-alls (comm 'a2a'), or Ulysses inside groups of ``a2a`` consecutive cp ranks and
    the ring across the groups ('a2a+ring') in every attention, the embedding's positions, the MoE
    layers' routing over the micro-batch. The attentions report their seconds to ``meter`` (one new
    Meter shared by them when None). Collective over cp_comm ('a2a+ring' splits it in two)."""
    meter = Meter() if meter is None else meter
    from ..nn.moe import MoE

    pos = positions(T, cp_comm.size, cp_comm.rank)
    if comm == "a2a+ring":                       # group j = cp ranks [j a2a, (j+1) a2a): Ulysses inside,
        j, i = divmod(cp_comm.rank, a2a)          # the ring across the groups' members of equal index i
        group = cp_comm.split(j, key=i, name=f"{cp_comm.name}/a2a{j}")
        across = cp_comm.split(i, key=j, name=f"{cp_comm.name}/ring{i}")

    def core():
        if comm == "ring":
            return RingAttentionCore(cp_comm, meter)
        if comm == "a2a":
            return UlyssesAttentionCore(cp_comm, T, meter)
        return UlyssesAttentionCore(group, T // across.size, meter, ring_comm=across)
    cores = []
    for top in model.modules():
        for m in top.modules():
            if isinstance(m, AttentionModule) and type(m.core) is CausalAttentionCore:
                child, ring = m.core, core()
                ring.keep_probs, ring.impl = child.keep_probs, child.impl
                if getattr(ring, "ring", None) is not None:
                    ring.ring.keep_probs, ring.ring.impl = child.keep_probs, child.impl
                m.core = ring
                cores.append(ring)
            if isinstance(m, TokenEmbedding):
                m.positions = pos
            if isinstance(m, MoE):
                m.cp_routing = CPRouting(cp_comm, pos, T)
    model.cp_cores = cores
    model.cp_positions = pos
    return model
