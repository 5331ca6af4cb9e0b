"""Data parallelism: bucketed gradient sync overlapped with backward, ZeRO-1, compression.

Parameters are packed, in REVERSE order of their place in the model (the head's last,
which backward finishes first), into flat buckets of about ``bucket_mb`` MiB, each padded
to a multiple of dp. After the first bucket fill each ``p.grad`` is a view into its
bucket's buffer, so the engine's ``p.grad += ...`` writes straight into it and nothing is
copied for the sync. The model tells us when a parameter's gradient is done for a
micro-batch (``model.grad_ready_hooks``, see ``attach``); a notification counts once the
parameter's last micro-batch of the step has begun: ``begin_micro(last=True)`` for the whole
model, or ``begin_final(params)`` for some of them (a pipeline stage's chunk: its last
micro-batch's backward starts while other chunks still have work). When every parameter of a
bucket is final, the bucket's nonblocking collective starts. Buckets start in one fixed order
(index order, with the buckets holding a ``launch_last`` parameter moved to the end), so every
rank issues the same collectives in the same order whatever order its grads arrive in. MPI
progress in pympar's own algorithms happens only inside test/wait, so every notification
also polls the requests in flight.

``finish()`` starts what is left, waits for everything and turns sums into means over dp
(with the engine's ``grad_scale = 1/n_micro`` the result is the mean over the global
batch). Plain DP allreduces each bucket; ZeRO-1 reduce-scatters it, keeps only its own
chunk and updates that chunk (see pympar.parallel.zero).

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
from ..optim import clip_grad_norm
from .compress import dense_allreduce_bytes, make_compressor
from .zero import ZeroAdamW, optimizer_memory


class Bucket:
    """A flat (padded,) buffer of grads of ``params``; pieces [offset, offset+size) each."""

    def __init__(self, index, params, names, dp):
        self.index = index
        self.params, self.names = params, names
        self.dtype = params[0].grad.dtype
        self.sizes = [int(p.grad.size) for p in params]
        self.offsets = list(np.cumsum([0] + self.sizes[:-1]))
        self.numel = int(sum(self.sizes))
        self.padded = -(-self.numel // dp) * dp               # a multiple of dp (reduce-scatter)
        self.buf = xp_of(params[0].grad).zeros(self.padded, dtype=self.dtype)   # (padded,) on the grads' device
        self.views = [self.buf[o:o + s].reshape(p.grad.shape)
                      for o, s, p in zip(self.offsets, self.sizes, params)]
        self.ids = {id(p) for p in params}
        self.chunk = self.padded // dp                        # ZeRO-1: rank r owns [r*chunk, (r+1)*chunk)
        self.reset()

    def reset(self):
        self.ready = set()
        self.request = None
        self.launched = self.done = False
        self.result = None                                    # ZeRO: the reduced chunk (chunk,)

    def gather_grads(self):
        """Make every p.grad the bucket's view (copying what the engine wrote elsewhere)."""
        for p, v in zip(self.params, self.views):
            if p.grad is not v:
                v[...] = p.grad
                p.grad = v


def build_buckets(named_params, dp: int, bucket_mb: float):
    """Reverse order of the model's parameters, cut every ~bucket_mb MiB (and where dtype changes)."""
    items = list(named_params)[::-1]
    limit = max(1, int(bucket_mb * 2**20))
    buckets, cur, names, nbytes = [], [], [], 0
    for name, p in items:
        if cur and (nbytes + p.grad.nbytes > limit or p.grad.dtype != cur[0].grad.dtype):
            buckets.append(Bucket(len(buckets), cur, names, dp))
            cur, names, nbytes = [], [], 0
        cur.append(p)
        names.append(name)
        nbytes += p.grad.nbytes
    if cur:
        buckets.append(Bucket(len(buckets), cur, names, dp))
    return buckets


class DataParallel:
    """Gradient sync over the data-parallel communicator ``dp_comm`` (any pympar Communicator).

    bucket_mb: bucket size in MiB; overlap: start each bucket during backward (False: all in
    finish()); compress: None | 'fp16' | 'bf16' | 'topk:<ratio>' (see compress.py);
    zero: ZeRO-1 distributed optimiser (the step updates only this rank's chunk);
    launch_last: parameters whose gradient is only final after a sum outside backward (a
    pipeline's tied embedding copy): their buckets start after every other bucket, so they
    do not hold the others back.
    """

    def __init__(self, named_params, dp_comm, bucket_mb=25.0, overlap=True, compress=None,
                 zero=False, launch_last=()):
        self.named = list(named_params)
        if not self.named:
            raise ValueError("DataParallel got no parameters")
        self.comm = dp_comm
        self.dp = int(dp_comm.size)
        self.bucket_mb = float(bucket_mb)
        if self.bucket_mb <= 0:
            raise ValueError(f"bucket_mb={bucket_mb} must be > 0")
        self.overlap = bool(overlap)
        self.compressor = make_compressor(compress)
        self.zero = bool(zero)
        self.buckets = build_buckets(self.named, self.dp, self.bucket_mb)
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        late = {id(p) for p in launch_last}
        # the launch order: index order, buckets holding a late parameter last (same on every rank)
        self.order = [b for b in self.buckets if not b.ids & late] + [b for b in self.buckets if b.ids & late]
        self.grad_bytes = int(sum(b.buf.nbytes for b in self.buckets))   # the buffers synced per step
        self._zero_opt = None
        self._sync = True
        self._next = 0                                      # next position in self.order to launch
        self.totals = dict(steps=0, bytes_sent=0, payload_bytes=0, collectives=0, comm_s=0.0,
                           exposed_s=0.0, span_s=0.0, launched_early=0)
        self.last = {}
        self.begin_step()

    # --- wiring -----------------------------------------------------------------------------
    def attach(self, model):
        """Register grad_ready on the model's backward notifications (GPT.grad_ready_hooks)."""
        hooks = getattr(model, "grad_ready_hooks", None)
        if hooks is None:
            raise TypeError(f"{type(model).__name__} has no grad_ready_hooks: use DataParallel without "
                            "attach() (every bucket then starts in finish())")
        if self.grad_ready not in hooks:
            hooks.append(self.grad_ready)
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
        self._t_first = None
        # launched_early: buckets started before finish() (during backward)
        self.last = dict(bytes_sent=0, payload_bytes=0, collectives=0, comm_s=0.0, exposed_s=0.0,
                         launched_early=0)

    def begin_micro(self, last: bool):
        """Say whether the coming micro-batch is the step's last: only then do buckets sync."""
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

    def grad_ready(self, params):
        """Backward finished these parameters' grads for this micro-batch (model hook)."""
        if self._finished:
            self.begin_step()
        if self.overlap and (self._sync or self._final):
            for p in params:
                b = self.bucket_of.get(id(p))
                if b is not None and (self._sync or id(p) in self._final):
                    b.ready.add(id(p))
            self._launch(only_ready=True)
        self._poll()

    def finish(self):
        """Start the buckets not started yet, wait for all, average over dp."""
        if self._finished:
            self.begin_step()
        t0 = time.perf_counter()
        self._launch(only_ready=False)
        for b in self.buckets:
            if not b.done:
                self._complete(b, b.request.wait() if b.request is not None else None)
        now = time.perf_counter()
        self.last["exposed_s"] = now - t0
        self.last["comm_s"] += now - t0
        self.last["span_s"] = (now - self._t_first) if self._t_first is not None else 0.0
        self._finished = True
        for k in ("bytes_sent", "payload_bytes", "collectives", "comm_s", "exposed_s", "span_s", "launched_early"):
            self.totals[k] += self.last[k]
        self.totals["steps"] += 1

    def step(self, optimizer, lr=None, clip=0.0, allreduce_sq=None):
        """Clip to the global norm and update; returns the norm before clipping.

        Plain DP: optimizer (pympar.optim.AdamW) steps on the averaged full grads.
        ZeRO-1: a ZeroAdamW with the optimizer's hyper-parameters updates this rank's chunk
        and allgathers the parameters (the optimizer's own m, v are never touched).
        allreduce_sq sums a sum of squares over the OTHER groups (tp, pp); dp is handled here.
        """
        if not self.zero:
            norm = clip_grad_norm([p for _, p in self.named], clip, allreduce_sq)
            optimizer.step(lr)
            return norm
        if self._zero_opt is None:
            self._zero_opt = ZeroAdamW.from_optimizer(optimizer, self.buckets, self.comm)
        return self._zero_opt.step(lr, clip, allreduce_sq)

    def export_optimizer_state(self, optimizer):
        """ZeRO-1, collective: fill optimizer (pympar AdamW) with the full m, v and step, e.g.
        before a checkpoint save. Plain DP: nothing to do (the optimizer holds its state)."""
        if self.zero and self._zero_opt is not None:
            self._zero_opt.export_to(optimizer)

    def import_optimizer_state(self, optimizer):
        """ZeRO-1: load this rank's chunks from optimizer's m, v, step and the model's
        parameters, e.g. after a checkpoint restore into them."""
        if self.zero:
            if self._zero_opt is None:
                self._zero_opt = ZeroAdamW.from_optimizer(optimizer, self.buckets, self.comm)
            self._zero_opt.import_from(optimizer)

    def grads_finite(self) -> bool:
        """After finish(): are all synced gradients finite (the same answer on every rank)?"""
        if not self.zero:
            return all(bool(xp_of(b.buf).isfinite(b.buf).all()) for b in self.buckets)
        bad = np.array([sum(0 if xp_of(b.result).isfinite(b.result).all() else 1  # host count
                            for b in self.buckets)], np.float64)
        if self.dp > 1:                                  # chunks differ per rank: agree
            bad = np.asarray(self.comm.allreduce(bad)).reshape(-1)   # host vector over MPI
        return bool(bad[0] == 0)

    def scale_grads(self, alpha):
        """After finish(): multiply the synced gradients by alpha (loss-scale unscaling)."""
        for b in self.buckets:
            g = b.result if self.zero else b.buf
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
        b.gather_grads()
        b.launched = True
        n = self.dp
        if n == 1:
            self._complete(b, None)
        elif self.compressor is not None:             # blocking: compressors use alltoall/allgather
            out, nb = self.compressor.reduce_mean(self.comm, b.index, b.buf, self.zero)
            self._count(nb["payload"], nb["wire"], nb["collectives"])
            self._complete(b, out, mean=True)
        elif self.zero:
            self._count(b.buf.nbytes, (n - 1) * b.buf.nbytes // n, 1)
            if hasattr(self.comm, "ireduce_scatter"):
                b.request = self.comm.ireduce_scatter(b.buf)
            else:                                     # no nonblocking form: reduce now
                self._complete(b, self.comm.reduce_scatter(b.buf))
        else:
            nb = dense_allreduce_bytes(b.buf.nbytes, n)
            self._count(nb["payload"], nb["wire"], 1)
            if hasattr(self.comm, "iallreduce"):
                b.request = self.comm.iallreduce(b.buf)
            else:
                self._complete(b, self.comm.allreduce(b.buf))
        self.last["comm_s"] += time.perf_counter() - t0

    def _count(self, payload, wire, n_coll):
        self.last["payload_bytes"] += int(payload)
        self.last["bytes_sent"] += int(wire)
        self.last["collectives"] += n_coll

    def _poll(self):
        """Let the nonblocking collectives in flight progress (cheap when none are)."""
        t0 = time.perf_counter()
        busy = False
        for b in self.order[:self._next]:
            if b.request is not None and not b.done:
                busy = True
                if b.request.test():
                    self._complete(b, b.request.wait())
        if busy:
            self.last["comm_s"] += time.perf_counter() - t0

    def _complete(self, b, result, mean=False):
        """Store the reduced values: means in b.buf (plain DP) or in b.result (ZeRO chunk).

        result: None (reduced in place in b.buf), the reduced array, or (mean=True) a mean."""
        n = self.dp
        if self.zero:
            if n == 1:
                b.result = b.buf.copy()                       # (chunk,) = everything
            else:
                b.result = xp_of(b.buf).array(b.buf if result is None else result, dtype=b.dtype).reshape(-1)
                if not mean:
                    b.result *= b.dtype.type(1.0 / n)
        elif n > 1:
            if result is not None and result is not b.buf:
                b.buf[...] = result.reshape(-1)
            if not mean:
                b.buf *= b.dtype.type(1.0 / n)
        b.done = True

    # --- reporting --------------------------------------------------------------------------
    def stats(self):
        """Last step's and cumulative figures: bytes sent (wire estimate and payload), number of
        collectives, launched_early (buckets started during backward, before finish), comm_s
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

    def memory_report(self):
        """Optimiser bytes per rank, this layout against plain DP (see zero.optimizer_memory)."""
        return optimizer_memory(self.buckets, self.dp, self.zero)
