"""Data parallelism: bucketed gradient sync overlapped with backward, ZeRO-1/2/3, compression.

Parameters are packed, in REVERSE order of their place in the model (the head's last,
which backward finishes first), into buckets of about ``bucket_mb`` MiB (ZeRO-3: one bucket
per model piece, ``units``). The model tells us when a parameter's gradient is done for a
micro-batch (``model.grad_ready_hooks``, see ``attach``); when every parameter of a bucket is
done, the bucket's nonblocking collective starts. MPI progress in pympar's own algorithms
happens only inside test/wait, so every notification also polls the requests in flight.

zero=0: each ``p.grad`` is a view into its bucket's flat buffer (the engine's ``p.grad += ...``
writes straight into it); a notification counts once the parameter's last micro-batch of the
step has begun -- ``begin_micro(last=True)`` for the whole model, or ``begin_final(params)``
for some (a pipeline chunk's last micro-batch) -- and buckets start in one fixed order (index
order, buckets holding a ``launch_last`` parameter last), so every rank issues the same
collectives in the same order whatever order its grads arrive in. ``finish()`` allreduces
what is left and turns sums into means over dp.

zero>=1 (pympar.parallel.zero): a bucket is a ``RowBucket``, laid out rank-major by rows (it packs
its gradients, adds the reduced rows it keeps and allgathers its updated rows itself; this module
decides when and runs the collectives) and reduce-scattered,
so each rank keeps the mean gradient of its rows only (``b.grad_rows``: ZeRO-1 in the full
gradient's own rows, which are dead once packed; ZeRO-2/3 in ``b.acc``); ZeroAdamW updates those
rows and, for stages 1 and 2, one allgather per bucket returns the parameters. zero=1 syncs
once per step like zero=0 (the engine's full gradients persist over the step's micro-batches).
zero>=2 syncs a bucket every time all its parameters are done (every micro-batch) and
releases the full gradients right after packing them, accumulating the reduced rows: the
full-size gradient of a bucket exists only while its backward runs. zero=3 also keeps only
its rows of the parameters (``ParamGather`` assembles them around each use).

Usage, per optimiser step::

    dp = DataParallel(model.named_parameters(), mesh.dp_comm, bucket_mb=25, overlap=True)
    dp.attach(model)
    dp.begin_step()
    for i, (x, y) in enumerate(micro_batches):
        dp.begin_micro(last=(i == len(micro_batches) - 1))
        model.loss_and_grad(x, y, grad_scale=1 / len(micro_batches))
    dp.finish()
    norm = dp.step(optimizer, lr, clip=1.0)
"""
from __future__ import annotations

import time

import numpy as np

from ..backend import xp_of
from ..comm.exact import ExactSum
from ..optim.clip import clip_coefficient, sum_of_squares
from ..optim.adamw import decays
from .compress import dense_allreduce_bytes, make_compressor
from .placement import place
from .zero import RowBucket, ZeroAdamW, install_gather

MAX_INFLIGHT_BUCKETS = 2          # ZeRO reduce-scatters in flight at once (_track waits for the oldest)


class Bucket:
    """zero=0: a flat (padded,) buffer of grads of ``params``; pieces [offset, offset+size) each."""

    sharded = False

    def __init__(self, index, params, names, dp):
        self.index = index
        self.params, self.names = params, names
        place(params, zero=0, rows=None)         # whole gradients, no rows kept apart
        self.dtype = np.dtype(params[0].dtype)
        self.sizes = [int(np.prod(p.shape)) for p in params]
        self.offsets = list(np.cumsum([0] + self.sizes[:-1]))
        self.numel = int(sum(self.sizes))
        self.padded = -(-self.numel // dp) * dp               # a multiple of dp (compressors split it)
        self.buf = xp_of(params[0].data).zeros(self.padded, dtype=self.dtype)   # (padded,) on the params' device
        self.views = [self.buf[o:o + s].reshape(p.shape)
                      for o, s, p in zip(self.offsets, self.sizes, params)]
        for p, v in zip(params, self.views):     # the engine accumulates straight into the bucket
            if not p.has_grad:
                p.grad = v
        self.ids = {id(p) for p in params}
        self.reset()

    def reset(self):
        self.ready = set()
        self.launched = self.done = False

    def gather_grads(self):
        """Make every p.grad the bucket's view (copying what the engine wrote elsewhere)."""
        for p, v in zip(self.params, self.views):
            if p.grad is not v:
                v[...] = p.grad
                p.grad = v

    @property
    def persistent_bytes(self):
        return int(self.buf.nbytes)


def build_buckets(named_params, dp: int, bucket_mb: float, comm=None, zero=0, units=None, device="cpu"):
    """Reverse order of the model's parameters, cut every ~bucket_mb MiB (and where dtype changes);
    ``units`` (lists of names): one bucket per unit instead (ZeRO-3: a bucket is what one use
    of a model piece gathers)."""
    items = list(named_params)[::-1]
    limit = max(1, int(bucket_mb * 2**20))
    make = (lambda i, ps, ns: RowBucket(i, ps, ns, comm, zero, device)) if zero else (lambda i, ps, ns: Bucket(i, ps, ns, dp))
    groups = []
    if units is not None:
        where = {n: k for k, names in enumerate(units) for n in names}
        for name, p in items:
            k = where.get(name, -1)
            if groups and groups[-1][0] == k and p.dtype == groups[-1][1][0][1].dtype:
                groups[-1][1].append((name, p))
            else:
                groups.append((k, [(name, p)]))
    else:
        nbytes = 0
        for name, p in items:
            size = int(np.prod(p.shape)) * np.dtype(p.dtype).itemsize
            if groups and not (nbytes + size > limit or p.dtype != groups[-1][1][0][1].dtype):
                groups[-1][1].append((name, p))
                nbytes += size
            else:
                groups.append((None, [(name, p)]))
                nbytes = size
    return [make(i, [p for _, p in g], [n for n, _ in g]) for i, (_, g) in enumerate(groups)]


class DataParallel:
    """Gradient sync over the data-parallel communicator ``dp_comm`` (any pympar Communicator).

    bucket_mb: bucket size in MiB; overlap: start each bucket during backward (False: all in
    finish(); zero>=2 always syncs a bucket when it is done, that is its point);
    compress: None | 'fp16' | 'bf16' | 'topk:<ratio>' (see compress.py); zero: 0..3 (ZeRO stage,
    see the module docstring); launch_last: parameters whose gradient is only final after a sum
    outside backward (a pipeline's tied embedding copy): their buckets start after every other
    bucket, so they do not hold the others back; units: ZeRO-3's buckets (lists of names);
    device: where ZeRO-3 keeps its rows (the other stages use the parameters' device).
    """

    def __init__(self, named_params, dp_comm, bucket_mb=25.0, overlap=True, compress=None,
                 zero=0, launch_last=(), units=None, device="cpu", exact=False):
        self.named = list(named_params)
        # exact (the trainer's --deterministic): every micro-batch's gradient is one term of an
        # ExactSum per bucket (add_micro), reduced over the group by integer collectives in finish();
        # the terms come pre-scaled by 1/(the global batch), so nothing is averaged afterwards
        self.exact = bool(exact)
        if self.exact and compress:
            raise ValueError("deterministic gradients are exact sums: they cannot also be compressed")
        if not self.named:
            raise ValueError("DataParallel got no parameters")
        self.comm = dp_comm
        self.dp = int(dp_comm.size)
        self.bucket_mb = float(bucket_mb)
        if self.bucket_mb <= 0:
            raise ValueError(f"bucket_mb={bucket_mb} must be > 0")
        self.zero = int(zero)
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero={zero}: expected a ZeRO stage 0, 1, 2 or 3")
        self.overlap = bool(overlap)
        self.compressor = make_compressor(compress)
        self.buckets = build_buckets(self.named, self.dp, self.bucket_mb, dp_comm, self.zero,
                                     units if self.zero == 3 else None, device)
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        late = {id(p) for p in launch_last}
        # the launch order: index order, buckets holding a late parameter last (same on every rank)
        self.order = [b for b in self.buckets if not b.ids & late] + [b for b in self.buckets if b.ids & late]
        self._zero_opt = None
        self._sync = True
        self._next = 0                                      # next position in self.order to launch
        self.totals = dict(steps=0, bytes_sent=0, payload_bytes=0, collectives=0, comm_s=0.0,
                           exposed_s=0.0, span_s=0.0, launched_early=0)
        self.last = {}
        self.peak_inflight_bytes = 0                        # buffers of the collectives in flight, at most
        self.peak_full_grad_bytes = 0                       # zero>=2: full gradients alive at once, at most
        self._inflight = []                                 # [(bucket, request, send or None)], oldest first
        self.begin_step()

    @property
    def grad_bytes(self):
        """Bytes of the gradients this rank synchronises per step (the full local gradients)."""
        return int(sum(b.numel for b in self.buckets) * self.buckets[0].dtype.itemsize)

    # --- wiring -----------------------------------------------------------------------------
    def attach(self, model):
        """Register grad_ready on the model's backward notifications (GPT.grad_ready_hooks); under
        ZeRO-3 also make this sync's ParamGather the model's parameter scope."""
        hooks = getattr(model, "grad_ready_hooks", None)
        if hooks is None:
            raise TypeError(f"{type(model).__name__} has no grad_ready_hooks: use DataParallel without "
                            "attach() (every bucket then starts in finish())")
        if self.grad_ready not in hooks:
            hooks.append(self.grad_ready)
        if self.zero == 3:
            self.gather = install_gather(model, [self])
        return self

    # --- per step ---------------------------------------------------------------------------
    def begin_step(self):
        """Start a new optimiser step (before the first micro-batch)."""
        for b in self.buckets:
            b.reset()
        self._next = 0
        self._sync = True
        self._final = set()                         # ids whose next notification is final (begin_final)
        self._finished = False
        self._sums = {}                             # exact: id(parameter) -> its ExactSum of the step
        self._t_first = None
        # launched_early: buckets started before finish() (during backward)
        self.last = dict(bytes_sent=0, payload_bytes=0, collectives=0, comm_s=0.0, exposed_s=0.0,
                         launched_early=0)

    def begin_micro(self, last: bool):
        """Say whether the coming micro-batch is the step's last: only then do buckets sync
        (zero<=1; zero>=2 syncs every micro-batch)."""
        if self._finished:                          # a new step without begin_step()
            self.begin_step()
        self._sync = bool(last)

    def begin_final(self, params):
        """The backward now starting is the step's last for these parameters (a pipeline chunk's
        last micro-batch, see PipelineExecutor.final_backward_hooks): their next grad_ready
        notifications are final, whatever begin_micro said for the model as a whole."""
        if self._finished:
            self.begin_step()
        self._final.update(id(p) for p in params)

    def grad_ready(self, params, partial=False):
        """Backward finished these parameters' grads for this micro-batch (model hook). partial:
        they hold a complete part of it (the head's share of a tied weight): zero>=2 reduces what
        is there and adds the rest later; the others wait for the final notification."""
        if self._finished:
            self.begin_step()
        if self.exact:                              # each notified gradient is a term now (the head's share
            self._collect(params)                   # of a tied weight apart from the embedding's)
            return
        if partial and self.zero < 2:
            return
        if self.zero >= 2:                          # every completed bucket syncs now
            done = []
            for p in params:
                b = self.bucket_of.get(id(p))
                if b is not None:
                    b.ready.add(id(p))
                    if len(b.ready) == len(b.ids) and all(b is not x for x in done):
                        done.append(b)
            for b in sorted(done, key=lambda x: x.index):
                self.last["launched_early"] += 1
                self._start(b)
        elif self.overlap and (self._sync or self._final):
            for p in params:
                b = self.bucket_of.get(id(p))
                if b is not None and (self._sync or id(p) in self._final):
                    b.ready.add(id(p))
            self._launch(only_ready=True)
        self._poll()

    def add_micro(self):
        """exact: whatever gradient the parameters hold since they were last collected (this
        micro-batch's, or this pipeline action's) becomes a term of each parameter's ExactSum, and
        the gradients are cleared for the next one."""
        if self._finished:
            self.begin_step()
        self._collect(p for _, p in self.named)

    def _collect(self, params):
        for p in params:
            if id(p) not in self.bucket_of:
                continue
            g = p.fresh_grad()
            if g is None:
                continue
            self.exact_sum_of(p).add(np.asarray(g))  # a non-finite element sums to NaN on every rank
            if self.bucket_of[id(p)].sharded and self.zero >= 2:
                p.release_grad()
            else:
                p.zero_grad()                       # zeros when next read, or written over

    def exact_sum_of(self, p):
        """exact: parameter p's ExactSum of this step (made empty when it has none yet)."""
        if id(p) not in self._sums:
            self._sums[id(p)] = ExactSum(tuple(p.grad_shape or p.shape), p.dtype)
        return self._sums[id(p)]

    def _bucket_sum(self, b):
        """The bucket's ExactSum laid out as its reduction sends it: the parameters' sums one after
        another (zero=0, padded), or rank-major rows (ZeRO: the layout's pack, applied to indices)."""
        sizes = [int(np.prod(p.grad_shape or p.shape)) for p in b.params]
        acc = ExactSum(b.buf.shape if not b.sharded else (sum(sizes),), b.dtype)   # zero=0: the padded buffer
        o = 0
        for p, k in zip(b.params, sizes):
            part = self._sums.get(id(p))
            if part is not None:
                acc.top[o:o + k] = part.top
                acc.bins[o:o + k] = part.bins
            o += k
        return b.pack_exact(acc) if b.sharded else acc

    def _finish_exact(self):
        """The exact sums over the group (integer collectives: any algorithm, any number of ranks,
        the same bits), written where the synced gradients live; a non-finite term anywhere makes
        that element NaN on every rank (the step is then skipped, as agreed elsewhere)."""
        self.add_micro()                            # anything not collected yet
        for b in self.buckets:
            acc = self._bucket_sum(b)
            if b.sharded:
                rows = acc.reduce_scatter(self.comm).value() if self.dp > 1 else acc.value()
                b.filled = False
                b.add_rows(b.xp.asarray(rows))
            else:
                for p, v in zip(b.params, b.views):     # the views are the gradients again (not stale)
                    p.grad = v
                b.buf[...] = xp_of(b.buf).asarray(acc.allreduce(self.comm).value())
            b.done = True
        self._sums = {}

    def exact_local_sq(self, counts):
        """exact: this rank's share of the squared norm as a shape-() ExactSum of float64 squares
        (each exact) of the synced gradients it holds and counts (``counts(p)``)."""
        acc = ExactSum((), np.float64)
        for p, g in self.held_grads():
            if counts(p) and g.size:
                sq = np.asarray(g, np.float64).reshape(-1) ** 2
                acc.merge(ExactSum(sq.shape, np.float64).add(sq).total())
        return acc

    def finish(self):
        """Start the buckets not started yet, wait for all, average over dp."""
        if self._finished:
            self.begin_step()
        t0 = time.perf_counter()
        if self.exact:
            self._finish_exact()
        elif self.zero >= 2:                          # what backward left unsynced (or never notified)
            for b in self.buckets:
                if b.ready or not b.fired:
                    self._start(b)
            self._drain()
        else:
            self._launch(only_ready=False)
            self._drain()
        if self.zero and self.compressor is None and self.dp > 1 and not self.exact:
            for b in self.buckets:
                for g in b.reduced():                       # sums -> means, once
                    g *= b.dtype.type(1.0 / self.dp)
        now = time.perf_counter()
        self.last["exposed_s"] = now - t0
        self.last["comm_s"] += now - t0
        self.last["span_s"] = (now - self._t_first) if self._t_first is not None else 0.0
        self._finished = True
        for k in ("bytes_sent", "payload_bytes", "collectives", "comm_s", "exposed_s", "span_s", "launched_early"):
            self.totals[k] += self.last[k]
        self.totals["steps"] += 1

    # --- the optimizer step ---------------------------------------------------------------------
    def make_optimizer(self, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, decay_fn=decays):
        """ZeRO (zero>=1): the AdamW over this rank's rows (pympar.parallel.zero.ZeroAdamW)."""
        if not self.zero:
            raise ValueError("make_optimizer is ZeRO's: without ZeRO use pympar.optim.AdamW")
        return ZeroAdamW(self.optimizer_pieces(decay_fn), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def optimizer_pieces(self, decay_fn=decays):
        """(name, weight rows, grad rows getter, Shard of the rows, decays) of every parameter."""
        return [piece for b in self.buckets for piece in b.optimizer_pieces(decay_fn)]

    def step(self, optimizer, lr=None, clip=0.0, allreduce_sq=None):
        """Clip to the global norm and update; returns the norm before clipping.

        zero=0: optimizer (pympar.optim.AdamW) steps on the averaged full grads. ZeRO: the
        ZeroAdamW of make_optimizer() (an AdamW passed instead only lends its hyper-parameters)
        updates this rank's rows; stages 1 and 2 then allgather the parameters.
        allreduce_sq sums a sum of squares over the OTHER groups (tp, pp); dp is handled here.
        The norm, the clip and the update are the trainer's (``clip_and_update``, GradSync)."""
        if self.zero and not isinstance(optimizer, ZeroAdamW):
            if self._zero_opt is None:
                self._zero_opt = self.make_optimizer(optimizer.lr, (optimizer.beta1, optimizer.beta2),
                                                     optimizer.eps, optimizer.weight_decay)
            optimizer = self._zero_opt
        # the squared norm of the synced gradients: the whole mean gradient, the same on every rank,
        # or (ZeRO) this rank's rows, summed over the group
        sq = sum_of_squares([g for _, g in self.held_grads()])
        if self.zero and self.dp > 1:
            sq = float(np.asarray(self.comm.allreduce(np.array([sq]))).reshape(-1)[0])   # host
        if allreduce_sq is not None:
            sq = float(allreduce_sq(sq))
        return clip_and_update([self], optimizer, lr, clip, sq)

    def after_step(self):
        """ZeRO-1/2: allgather every bucket's updated rows into the full parameters."""
        if self.zero not in (1, 2):
            return
        for b in self.buckets:
            b.allgather_weights()

    def held_grads(self):
        """(Parameter, array) of the synced gradient this rank holds, after finish(): the full
        mean gradient (zero=0) or the mean of its rows (ZeRO)."""
        for b in self.buckets:
            for i, p in enumerate(b.params):
                yield p, (b.grad_rows(i) if b.sharded else p.grad)

    def scale_grads(self, alpha):
        """After finish(): multiply the synced gradients by alpha (loss-scale unscaling)."""
        for b in self.buckets:
            for g in (b.reduced() if b.sharded else [b.buf]):
                g *= b.dtype.type(alpha)

    # --- collectives ------------------------------------------------------------------------
    def _launch(self, only_ready):
        while self._next < len(self.order):
            b = self.order[self._next]
            if only_ready and len(b.ready) < len(b.ids):
                return
            if only_ready:                            # started before finish(): overlapped
                self.last["launched_early"] += 1
            self._start(b)
            self._next += 1

    def _start(self, b):
        t0 = time.perf_counter()
        if self._t_first is None:
            self._t_first = t0
        if b.sharded:
            self._start_rows(b)
        else:
            self._start_flat(b)
        self.last["comm_s"] += time.perf_counter() - t0

    def _start_flat(self, b):
        b.gather_grads()
        b.launched = True
        n = self.dp
        if n == 1:
            self._complete(b, None)
        elif self.compressor is not None:             # blocking: compressors use alltoall/allgather
            out, nb = self.compressor.reduce_mean(self.comm, b.index, b.buf, False)
            self._count(nb["payload"], nb["wire"], nb["collectives"])
            self._complete(b, out, mean=True)
        else:
            nb = dense_allreduce_bytes(b.buf.nbytes, n)
            self._count(nb["payload"], nb["wire"], 1)
            if hasattr(self.comm, "iallreduce"):
                self._track(b, self.comm.iallreduce(b.buf), None)
            else:
                self._complete(b, self.comm.allreduce(b.buf))

    def _start_rows(self, b):
        """Pack the full grads rank-major (RowBucket.pack_grads), release them (zero>=2),
        reduce-scatter the pack."""
        n = self.dp
        send = b.pack_grads()
        if self.zero >= 2:
            # full gradients alive now: those being filled, and the ones released whose buffer an
            # unfinished reduce-scatter still reads (a bucket of one evenly divided tensor)
            held = sum(p.grad.nbytes for _, p in self.named if p.has_grad) + \
                sum(x[2].nbytes for x in self._inflight if x[0].layout.identity)
            self.peak_full_grad_bytes = max(self.peak_full_grad_bytes, held)
            for p in b.params:
                p.release_grad()
        b.ready = set()
        b.fired += 1
        b.launched = True
        if n == 1:
            b.add_rows(send)
        elif self.compressor is not None:
            out, nb = self.compressor.reduce_mean(self.comm, b.index, send, True)
            self._count(nb["payload"], nb["wire"], nb["collectives"])
            b.add_rows(out)
        else:
            self._count(send.nbytes, (n - 1) * send.nbytes // n, 1)
            if hasattr(self.comm, "ireduce_scatter"):
                self._track(b, self.comm.ireduce_scatter(send), send)
            else:
                b.add_rows(self.comm.reduce_scatter(send))

    def _track(self, b, req, send):
        """Keep a started collective; at most MAX_INFLIGHT_BUCKETS at once (the oldest is waited
        for first): the packed copies and the MPI library's working buffers stay bounded."""
        while len(self._inflight) >= MAX_INFLIGHT_BUCKETS:
            self._complete_oldest()
        self._inflight.append((b, req, send))
        self.peak_inflight_bytes = max(self.peak_inflight_bytes, sum(inflight_bytes(*x) for x in self._inflight))

    def _complete_oldest(self):
        b, req, _ = self._inflight.pop(0)
        if b.sharded:
            b.add_rows(req.wait())
        else:
            self._complete(b, req.wait())

    def _drain(self):
        """Wait for every reduce-scatter in flight, in the order they started (the same order on
        every rank, so each bucket's rows are summed in one order)."""
        while self._inflight:
            self._complete_oldest()
        for b in self.buckets:
            if b.sharded:
                b.done = True

    def _count(self, payload, wire, n_coll):
        self.last["payload_bytes"] += int(payload)
        self.last["bytes_sent"] += int(wire)
        self.last["collectives"] += n_coll

    def _poll(self):
        """Let the nonblocking collectives in flight progress (cheap when none are)."""
        t0 = time.perf_counter()
        busy = False
        busy = bool(self._inflight)
        while self._inflight and self._inflight[0][1].test():
            self._complete_oldest()
        if busy:
            self.last["comm_s"] += time.perf_counter() - t0

    def _complete(self, b, result, mean=False):
        """zero=0: the mean in b.buf. result: None (reduced in place), the reduced array, or
        (mean=True) a mean."""
        n = self.dp
        if n > 1:
            if result is not None and result is not b.buf:
                b.buf[...] = result.reshape(-1)
            if not mean:
                b.buf *= b.dtype.type(1.0 / n)
        b.done = True

    # --- reporting --------------------------------------------------------------------------
    def stats(self):
        """Last step's and cumulative figures: bytes sent (wire estimate and payload), number of
        collectives, launched_early (buckets started before finish, during backward), comm_s
        (time inside comm calls), exposed_s (time blocked in finish),
        hidden_fraction = 1 - exposed / span (span: first bucket start to the end of finish; an
        upper bound: a transfer that only progresses inside finish's wait still counts its
        span; bench/dp_scaling.py compares against overlap=False for the real figure)."""
        last = dict(self.last)
        span = last.get("span_s", 0.0)
        last["hidden_fraction"] = (1.0 - last["exposed_s"] / span) if span > 0 else 0.0
        tot = dict(self.totals)
        tot["hidden_fraction"] = (1.0 - tot["exposed_s"] / tot["span_s"]) if tot["span_s"] > 0 else 0.0
        return dict(last=last, total=tot, n_buckets=len(self.buckets), dp=self.dp,
                    bucket_mb=self.bucket_mb, overlap=self.overlap, zero=self.zero,
                    compress=None if self.compressor is None else self.compressor.name)


def inflight_bytes(b, req, send) -> int:
    """Memory a collective in flight holds beyond the gradients: ZeRO's packed copy (none when the
    gradient itself is the buffer), and the MPI library's working buffers, counted as half the
    message (what MPICH's Iallreduce / Ireduce_scatter of a large message was seen to add)."""
    msg = b.buf.nbytes if send is None else send.nbytes
    copy = 0 if send is None or b.layout.identity else send.nbytes
    return copy + msg // 2


def clip_and_update(syncs, optimizer, lr, clip, total_sq: float) -> float:
    """The optimizer step of every gradient path (DataParallel.step, GradSync.step): clip the synced
    gradients of ``syncs`` by the global norm sqrt(total_sq), update, and (ZeRO-1/2) allgather the
    updated rows into every rank's parameters; returns the norm."""
    norm = float(np.sqrt(total_sq)) if total_sq >= 0 else float("nan")
    coef = clip_coefficient(norm, clip)
    if coef is not None:
        for d in syncs:
            d.scale_grads(coef)
    optimizer.step(lr)
    for d in syncs:
        d.after_step()
    return norm
