"""ZeRO: optimizer state (stage 1), gradients (2) and parameters (3) sharded over the dp group.

Sharding is per parameter along its first dimension (as FSDP2 and torchtitan do): of a local
tensor with n0 rows, rank r of a group of n keeps rows [r*part, min((r+1)*part, n0)) with
part = ceil(n0/n) (the last ranks may keep fewer rows, or none). The rows a rank keeps are a
Shard of the full tensor (``rows_shard``), so checkpoints store and reshard them like any
tensor-parallel shard, and the parameter's placement says which they are.

A bucket of parameters is laid out rank-major (``RowLayout``): segment r of a flat buffer of
n*S elements holds rank r's rows of every parameter of the bucket (each padded to ``part``
rows), so one reduce-scatter leaves every rank exactly its rows' gradient sum and one
allgather returns every rank's rows. ``RowBucket`` is such a bucket: the reduced gradient rows a rank keeps
(stages 1-3), its rows of the parameters themselves (stage 3) and their gathering; the data-
parallel sync (parallel.dp) builds the buckets and runs their collectives.

``ZeroAdamW`` keeps m and v only for the rows a rank keeps and updates the weights there in
place: the weights are the master copy (float32, or float64 in float64 runs), so nothing is
duplicated. Stages 1 and 2 then allgather the updated rows into every rank's full parameters;
stage 3 keeps only its rows (``ParamGather`` assembles a module's full parameters around its
forward and backward and frees them afterwards).

Memory per rank of float32 AdamW for P parameters (words): zero 0: 4P (params, grads, m, v);
zero 1: 2P + 2P/dp; zero 2: P + 3P/dp; zero 3: 4P/dp; plus transients of one bucket (the
send/receive buffers of a collective) and the modules gathered in flight.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from .. import kernels
from ..backend import get_xp, resident_zeros, xp_of
from ..optim.adamw import moments_like
from ..nn.module import NoGather  # noqa: F401  (the scope ParamGather replaces)
from .placement import place


# --- the rank-major layout of a bucket ------------------------------------------------------------
class RowLayout:
    """Rank-major flat layout of the dim-0 row chunks of tensors of ``shapes`` over ``n`` ranks."""

    def __init__(self, shapes, n: int, rank: int):
        self.n, self.rank = int(n), int(rank)
        self.items = []                          # (shape, n0, row, part, off, lo, hi)
        off = 0
        for shape in shapes:
            shape = tuple(int(s) for s in shape) or (1,)
            n0, row = shape[0], int(math.prod(shape[1:]))
            part = -(-n0 // self.n)
            lo = min(self.rank * part, n0)
            hi = min(lo + part, n0)
            self.items.append((shape, n0, row, part, off, lo, hi))
            off += part * row
        self.seg = off                           # S: one rank's segment
        # one tensor whose rows divide evenly: the rank-major layout IS the tensor's own
        self.identity = len(self.items) == 1 and self.items[0][1] % self.n == 0

    def rows(self, i):
        """(lo, hi): rows of tensor i this rank keeps."""
        return self.items[i][5], self.items[i][6]

    def own(self, seg, i):
        """Tensor i's rows of this rank inside a segment (S,) (a view, shaped like the rows)."""
        shape, _, row, _, off, lo, hi = self.items[i]
        return seg[off:off + (hi - lo) * row].reshape((hi - lo,) + shape[1:])

    def _views(self, flat, i):
        shape, n0, row, part, off, _, _ = self.items[i]
        v = flat.reshape(self.n, self.seg)[:, off:off + part * row].reshape(self.n, part, row)
        return v, n0, row, part

    def pack(self, arrays, out):
        """Full tensors (None: zeros) -> ``out`` (n*S,), rank-major; padding rows are zero."""
        for i, a in enumerate(arrays):
            v, n0, row, part = self._views(out, i)
            if a is None:
                v[...] = 0
                continue
            a2 = a.reshape(n0, row)
            k = n0 // part                       # ranks with a whole chunk
            if k:
                v[:k] = a2[:k * part].reshape(k, part, row)
            rem = n0 - k * part
            if rem:
                v[k, :rem] = a2[k * part:]
                v[k, rem:] = 0
            start = k + (1 if rem else 0)               # ranks past the last row keep padding only
            if start < self.n:
                v[start:] = 0
        return out

    def unpack(self, flat, arrays):
        """``flat`` (n*S,), rank-major -> into the full tensors (every rank's rows)."""
        for i, a in enumerate(arrays):
            v, n0, row, part = self._views(flat, i)
            a2 = a.reshape(n0, row)
            k = n0 // part
            if k:
                a2[:k * part] = v[:k].reshape(k * part, row)
            rem = n0 - k * part
            if rem:
                a2[k * part:] = v[k, :rem]
        return arrays


def rows_shard(shard, full_shape, lo: int, hi: int):
    """The Shard of the full tensor that rows [lo, hi) of a local tensor hold; the local tensor is
    ``shard`` of the full one (None: the full tensor itself)."""
    from .shard import Shard

    full_shape = tuple(full_shape)
    if shard is None:
        return Shard(full_shape, (slice(lo, hi),))
    blocks = shard.blocks()
    out, pos = [], 0
    for a, b in blocks[0]:                       # the local rows walk the blocks of dim 0 in order
        s, e = max(lo, pos), min(hi, pos + b - a)
        if s < e:
            out.append(slice(a + s - pos, a + e - pos))
        pos += b - a
    if not out:
        out = [slice(0, 0)]
    first = out[0] if len(out) == 1 else tuple(out)
    return Shard(full_shape, (first,) + tuple(shard.index[1:]))


# --- the optimizer over kept rows -----------------------------------------------------------------
class ZeroAdamW:
    """AdamW over the rows this rank keeps of every parameter of DataParallel buckets.

    ``pieces``: per parameter (name, weight rows view, grad-rows getter, Shard of the rows,
    decays); the buckets own the storage. m and v have the shape of the kept rows."""

    def __init__(self, pieces, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, moments_dtype=None):
        self.lr, self.beta1, self.beta2, self.eps, self.weight_decay = lr, betas[0], betas[1], eps, weight_decay
        self.pieces = list(pieces)
        self.m, self.v = {}, {}
        for name, w, _, _, _ in self.pieces:            # (moments_like writes the zeros: resident at once)
            self.m[name] = moments_like(w, moments_dtype)
            self.v[name] = moments_like(w, moments_dtype)
        self.step_count = 0

    def step(self, lr=None):
        """One update of the kept rows from their reduced gradient (grads are left as they are)."""
        lr = self.lr if lr is None else lr
        self.step_count += 1
        for name, w, grad_of, _, dec in self.pieces:
            if w.size:
                kernels.adamw_step(w, grad_of(), self.m[name], self.v[name], lr=lr, beta1=self.beta1,
                                   beta2=self.beta2, eps=self.eps, weight_decay=self.weight_decay if dec else 0.0,
                                   step=self.step_count)

    def state_bytes(self) -> int:
        return int(sum(a.nbytes for a in self.m.values()) + sum(a.nbytes for a in self.v.values()))

    # checkpoints: the kept rows of m and v are pieces of the full moments (any layout reads them)
    def checkpoint_shards(self):
        shards = {}
        for name, w, _, sh, _ in self.pieces:
            if w.size:
                shards[f"m.{name}"] = (self.m[name], sh)
                shards[f"v.{name}"] = (self.v[name], sh)
        return shards, {"step": self.step_count}

    def load_checkpoint_shards(self, loaded, scalars):
        for key, arr in loaded.items():
            kind, name = key.split(".", 1)
            dst = (self.m if kind == "m" else self.v)[name]
            dst[...] = xp_of(dst).asarray(np.asarray(arr).astype(dst.dtype, copy=False))
        self.step_count = int(scalars.get("step", self.step_count))


# --- a bucket of rows: what a rank keeps of a group of parameters -----------------------------
class RowBucket:
    """zero>=1: ``params`` laid out rank-major by rows over the group (zero.RowLayout).

    grad_rows(i): the mean gradient of this rank's rows of parameter i (after finish): a view of
    the full gradient under ZeRO-1, of acc (S,) under ZeRO-2/3.
    ZeRO-3: own (S,) holds this rank's rows of the parameters themselves (p.data is a view of
    it between uses); ``start_gather``/``finish_gather``/``release_params`` assemble and free the
    full parameters over the group, and gathered/uses/gather_req are ParamGather's bookkeeping."""

    sharded = True

    def __init__(self, index, params, names, comm, zero, device="cpu"):
        self.index, self.params, self.names, self.comm = index, params, names, comm
        self.dtype = np.dtype(params[0].dtype)
        self.ids = {id(p) for p in params}
        self.layout = lay = RowLayout([p.shape for p in params], comm.size, comm.rank)
        for i, p in enumerate(params):           # before ZeRO-3 makes .shard the rows (tp is read from it)
            place([p], zero=zero, rows=lay.rows(i))
        self.numel = int(sum(np.prod(p.shape) for p in params))
        # ZeRO-3 makes its rows on the host and keeps them on the device; 1/2 live where the params do
        xp = get_xp(device) if zero == 3 else xp_of(params[0].data)
        self.xp = xp
        # the Shard of the full tensor each parameter's kept rows are (checkpoints, placement)
        self.row_shards = [rows_shard(p.shard, p.full_shape, *lay.rows(i)) for i, p in enumerate(params)]
        self.full_bytes = int(self.numel * self.dtype.itemsize)
        self.own = None
        self.gathered, self.uses, self.gather_req = False, 0, None
        self._exact_perm = None                  # --deterministic: pack_exact's permutation, made once
        if zero == 3:                            # keep only the rows: the full tensor is never made
            self.own = xp.zeros(lay.seg, dtype=self.dtype)
            self.rest = []
            for i, p in enumerate(params):
                lo, hi = lay.rows(i)
                v = lay.own(self.own, i)
                if p.materialized:
                    v[...] = xp.asarray(p.data[lo:hi])
                else:
                    p.shard = self.row_shards[i]
                    v[...] = xp.asarray(p.data)      # made for these rows alone
                p.data = v
                p.shard = self.row_shards[i]
                p.grad_shape = self.local_shape(i)    # the gradient stays the whole tensor's
                self.rest.append(v)
        # the reduced rows: ZeRO-1's full gradients are the engine's accumulators for the whole step
        # (resident from the start) and, once reduced, hold the mean of this rank's rows in their own
        # rows; ZeRO-2/3 keep the reduced rows in acc (persistent, written in place every step)
        self.zero = zero
        if zero == 1:
            self.acc = None
            for p in params:
                if not p.has_grad:
                    p.grad = resident_zeros(p.shape, self.dtype, xp)
        else:
            self.acc = resident_zeros(lay.seg, self.dtype, xp)
        self.reset()

    def reset(self):
        self.ready = set()
        self.fired = 0
        self.filled = False                      # acc holds this step's rows (else last step's)
        self.launched = self.done = False

    def grad_rows(self, i):
        """Parameter i's reduced gradient rows (a view: of the full gradient under ZeRO-1, else of acc)."""
        if self.acc is None:
            lo, hi = self.layout.rows(i)
            return self.params[i].grad[lo:hi]
        return self.layout.own(self.acc, i)

    def reduced(self):
        """The arrays holding this rank's reduced rows (to scale or check them)."""
        return [self.acc] if self.acc is not None else [self.grad_rows(i) for i in range(len(self.params))]

    def weight_rows(self, i):
        """Parameter i's rows this rank updates (a view: of own under ZeRO-3, else of p.data)."""
        if self.own is not None:
            return self.rest[i]
        lo, hi = self.layout.rows(i)
        return self.params[i].data[lo:hi]

    @property
    def persistent_bytes(self):
        """Gradient storage of its own (ZeRO-1's lives in the full gradients, counted with them)."""
        return int(self.acc.nbytes) if self.acc is not None else 0

    def local_shape(self, i):
        """The full local (tp) shape of parameter i (its rows are what p.data holds)."""
        return self.layout.items[i][0]

    # --- the gradients' reduce-scatter (the data-parallel sync runs the collective) ----------------
    def pack_grads(self):
        """The full gradients laid out rank-major, (n*S,), ready to reduce-scatter: a bucket of one
        evenly divided tensor sends the gradient itself, else a new buffer (a missing gradient
        packs as zeros)."""
        lay = self.layout
        if lay.identity and self.params[0].has_grad:
            return self.params[0].grad.reshape(-1)
        return lay.pack([p.grad if p.has_grad else None for p in self.params],
                        self.xp.empty(self.comm.size * lay.seg, dtype=self.dtype))

    def add_rows(self, rows):
        """This rank's reduced rows (S,) into its kept gradient rows: the first sum of the step is
        written, later ones (ZeRO-2/3: one per micro-batch) added."""
        rows = rows.reshape(-1)
        if self.acc is None:                     # ZeRO-1: into the full gradients' own rows
            for i in range(len(self.params)):
                if self.filled:
                    self.grad_rows(i)[...] += self.layout.own(rows, i)
                else:
                    self.grad_rows(i)[...] = self.layout.own(rows, i)
        elif self.filled:
            self.acc += rows
        else:
            self.acc[...] = rows
        self.filled = True

    def pack_exact(self, acc):
        """--deterministic: the bucket's ExactSum (the parameters' sums one after another) laid out
        rank-major as pack_grads lays out the gradients, ready for its reduce-scatter."""
        from ..comm.exact import ExactSum

        if self._exact_perm is None:             # packed position -> index + 1 (0: padding)
            idx, o = [], 0
            for p in self.params:
                shape = p.grad_shape or p.shape
                k = int(np.prod(shape))
                idx.append(np.arange(o + 1, o + k + 1, dtype=np.float64).reshape(shape))  # host
                o += k
            self._exact_perm = self.layout.pack(idx, np.empty(self.comm.size * self.layout.seg, np.float64)  # host
                                                ).astype(np.int64)
        perm = self._exact_perm
        out = ExactSum(perm.shape, self.dtype)
        live = perm > 0
        out.top[live] = acc.top[perm[live] - 1]
        out.bins[live] = acc.bins[perm[live] - 1]
        return out

    # --- ZeRO-1/2: the updated rows back into every rank's full parameters --------------------------
    def allgather_weights(self):
        """After the optimizer updated this rank's rows: one allgather over the group puts every
        rank's rows into the full parameters (ZeRO-1/2)."""
        lay = self.layout
        send = self.xp.empty(lay.seg, dtype=self.dtype)
        for i in range(len(self.params)):
            lay.own(send, i)[...] = self.weight_rows(i)
        if self.comm.size == 1:
            return                                   # the rows were the whole parameter
        # the library's allgather writes straight into its output (a shared-memory one would keep
        # a window of the whole message mapped in every rank)
        if lay.identity:                             # every rank's rows land in the parameter itself
            self.comm.allgather(send, out=self.params[0].data.reshape(-1), algo="mpi")
            return
        full = self.comm.allgather(send, algo="mpi")
        lay.unpack(xp_of(send).asarray(full).reshape(-1), [p.data for p in self.params])

    def optimizer_pieces(self, decay_fn):
        """(name, weight rows, grad rows getter, Shard of the rows, decays) of each parameter: what
        ZeroAdamW updates."""
        return [(name, self.weight_rows(i), (lambda i=i: self.grad_rows(i)), self.row_shards[i],
                 bool(decay_fn(name, p.data))) for i, (p, name) in enumerate(zip(self.params, self.names))]

    # --- ZeRO-3: the parameters around their use (ParamGather calls these) ----------------------
    def start_gather(self):
        """Begin assembling the full parameters from every rank's rows (None: one rank, nothing to do)."""
        if self.comm.size == 1:
            return None
        return self.comm.iallgather(self.own)

    def finish_gather(self, req):
        flat = self.own if req is None else req.wait().reshape(-1)
        fulls = [self.xp.empty(self.local_shape(i), dtype=self.dtype) for i in range(len(self.params))]
        self.layout.unpack(flat, fulls)
        for p, f in zip(self.params, fulls):
            p.data = f
        self.gathered = True

    def release_params(self):
        """Back to this rank's rows (the full tensors are freed)."""
        for p, v in zip(self.params, self.rest):
            p.data = v
        self.gathered = False



# --- ZeRO-3: a module's full parameters around its use ------------------------------------------
class ParamGather:
    """Assembles the full (tp-local) parameters of a module from the dp group's rows for its
    forward or backward and frees them after; prefetches the next module's in the same order.

    units: the buckets (one per model piece and group) of every DataParallel with zero=3; a
    module's parameters may sit in several (the head uses the embedding's wte; a MoE block's
    experts are in the expert group's)."""

    enabled = True

    def __init__(self, syncs, order):
        self.unit_of = {}
        self.units = []
        for d in syncs:
            for b in d.buckets:
                self.units.append(b)
                for p in b.params:
                    self.unit_of[id(p)] = b
        self.order = order                         # modules in forward order
        self.pos = {id(m): i for i, m in enumerate(order)}
        self.gathered_bytes = self.peak_gathered_bytes = 0
        self.gathers = 0

    def _units_of(self, module):
        params = list(module.parameters())
        w = getattr(module, "wte", None)
        if w is not None and all(w is not q for q in params):
            params.append(w)
        out = []
        for p in params:
            u = self.unit_of.get(id(p))
            if u is not None and all(u is not x for x in out):
                out.append(u)
        return out

    def _start(self, u):
        if u.gather_req is None and not u.gathered:
            u.gather_req = u.start_gather()
            self.gathers += 1

    def _ready(self, u):
        if not u.gathered:
            self._start(u)
            u.finish_gather(u.gather_req)
            u.gather_req = None
            self.gathered_bytes += u.full_bytes
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def _release(self, u):
        if u.gathered and u.uses == 0 and u.gather_req is None:
            u.release_params()
            self.gathered_bytes -= u.full_bytes

    def _neighbour(self, module, step):
        i = self.pos.get(id(module))
        j = None if i is None else i + step
        return self.order[j] if j is not None and 0 <= j < len(self.order) else None

    @contextlib.contextmanager
    def use(self, *modules, backward=False):
        """with gather.use(block): block's parameters are whole inside; the next module's (in
        forward order, or in backward order when ``backward``) are fetched meanwhile."""
        units = [u for m in modules for u in self._units_of(m)]
        for u in units:
            self._ready(u)
            u.uses += 1
        nxt = self._neighbour(modules[0], -1 if backward else 1)
        if nxt is not None:
            for u in self._units_of(nxt):
                self._start(u)
        try:
            yield
        finally:
            for u in units:
                u.uses -= 1
            for u in units:
                self._release(u)

    def settle(self):
        """Complete prefetches nobody used (the end of a pass) so no gather stays in flight."""
        for u in self.units:
            if u.gather_req is not None:
                u.finish_gather(u.gather_req)
                u.gather_req = None
                self.gathered_bytes += u.full_bytes
            if u.uses == 0:
                self._release(u)


def install_gather(model, syncs):
    """ZeRO-3: a ParamGather over ``syncs``' buckets as the parameter scope of ``model`` (a GPT or
    TPGPT, or each chunk of a PipelineGPT), in the model's forward order; returns it."""
    holders = list(model.chunks) if hasattr(model, "chunks") else [model]
    gather = ParamGather(syncs, [m for h in holders for m in h.pieces()])
    for h in holders:
        h.param_gather = gather
    return gather
