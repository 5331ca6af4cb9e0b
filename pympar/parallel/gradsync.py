"""Gradient synchronisation of a composed (dp, pp, tp, ep) layout, and its global norm.

What each rank holds after backward (the pipeline executor has already summed the tied
wte between the first and last stage, and the sequence-parallel partial grads over tp):

    dense params   (1/n_micro) * sum over THIS rank's micro-batches     -> mean over dp
    expert params  (1/n_micro) * sum over its ep group's micro-batches  -> mean over edp, x 1/ep

(see pympar.parallel.ep for the 1/ep). Each kind is one ``DataParallel`` (buckets overlapped
with backward, optional ZeRO-1 and compression) over its group: dense over ``mesh.dp_comm``,
expert over ``mesh.edp_comm``. With ZeRO-1 the optimiser state of expert parameters is
therefore sharded over edp and that of dense parameters over dp.

Overlap under a pipeline: the executor calls ``begin_final(params)`` as the last micro-batch's
backward of each chunk begins, so a bucket starts as soon as its parameters' grads are final,
during the backward of the other chunks and the pipeline's drain, as DP alone does in its last
micro-batch. The tied wte copy's gradient is final only after the first/last-stage sum at the
end of the step (its grad_ready comes then), so its bucket starts after all the others.

Global norm. After the sync every gradient element is held identically by several ranks;
the single-process norm counts it once. ``local_sq()`` counts, on this rank, the elements it
"owns" and one sum over the world gives the norm:

    dp / edp   plain: the dp (edp) rank 0 of each group; ZeRO-1: every rank its own chunk
    tp         sharded params (``param.shard``) on every tp rank; replicated ones on tp rank 0
    pp         the last stage's copy of the tied wte never (stage 0 counts it)
    ep         expert params on every ep rank (they hold different experts)
"""
from __future__ import annotations

import numpy as np

from ..backend import xp_of
from ..optim import clip_grad_norm
from ..optim.clip import host_scalars, sum_sq
from .dp import DataParallel
from .ep import is_expert_param
from .shard import shard_of


class ComposedGradSync:
    """Dense grads mean over dp, expert grads over edp (x 1/ep); the norm over the whole mesh.

    named: the rank's (global name, Parameter); mesh: pympar.parallel.mesh.Mesh; tied_copy:
    the Parameter that duplicates stage 0's wte on the last stage (None otherwise); dp_kw:
    DataParallel's bucket_mb, overlap, compress, zero. Per step: begin_step(), begin_micro(last)
    before each micro-batch (or once with last=False under a pipeline, whose executor then calls
    begin_final(params) per chunk), finish(), then local_sq()/nonfinite() and step(opt, lr,
    clip, total_sq).
    """

    def __init__(self, named, mesh, tied_copy=None, **dp_kw):
        self.mesh = mesh
        self.zero = bool(dp_kw.get("zero", False))
        split = mesh.ep > 1
        dense = [(n, p) for n, p in named if not (split and is_expert_param(n))]
        expert = [(n, p) for n, p in named if split and is_expert_param(n)]
        self.params = [p for _, p in named]
        # (DataParallel, post-scale, owner-when-plain): the dp (edp) rank 0 counts replicated grads
        late = [tied_copy] if tied_copy is not None else []     # final after the tied sum only
        self.groups = [(DataParallel(dense, mesh.dp_comm, launch_last=late, **dp_kw), 1.0, mesh.dp_rank == 0)]
        if expert:
            self.groups.append((DataParallel(expert, mesh.edp_comm, **dp_kw), 1.0 / mesh.ep, mesh.edp_rank == 0))
        self.grad_bytes = sum(d.grad_bytes for d, _, _ in self.groups)
        tied = id(tied_copy) if tied_copy is not None else None
        # per parameter: does this rank count its gradient in the norm (apart from dp/edp)?
        self._counts = {id(p): id(p) != tied and (shard_of(p) is not None or mesh.tp_rank == 0)
                        for p in self.params}

    def counts_in_norm(self, p) -> bool:
        """Apart from dp/edp: does this rank count p's gradient (not the tied copy; tp-replicated
        params only on tp rank 0)?"""
        return self._counts[id(p)]

    @property
    def syncs(self):
        return [d for d, _, _ in self.groups]

    def attach(self, model):
        for d in self.syncs:
            d.attach(model)
        return self

    def begin_step(self):
        for d in self.syncs:
            d.begin_step()

    def begin_micro(self, last: bool):
        for d in self.syncs:
            d.begin_micro(last)

    def begin_final(self, params):
        """The step's last backward of params begins (PipelineExecutor.final_backward_hooks)."""
        for d in self.syncs:
            d.begin_final(params)

    def finish(self):
        """Wait for every bucket; dense grads are then the dp mean, expert grads the edp sum / dp."""
        for d, scale, _ in self.groups:
            d.finish()
            if scale != 1.0:
                d.scale_grads(scale)

    def scale_grads(self, alpha):
        for d in self.syncs:
            d.scale_grads(alpha)

    def _synced(self):
        """(DataParallel, owner, bucket, g, lo): g the synced gradient elements [lo, lo+len(g)) of
        the bucket held here (ZeRO-1: this rank's reduced chunk; plain: the whole bucket)."""
        for d, _, owner in self.groups:
            for b in d.buckets:
                if d.zero:
                    yield True, b, b.result, d.comm.rank * b.chunk
                else:
                    yield owner, b, b.buf, 0

    def local_sq(self) -> float:
        """This rank's share of the squared global norm (sum over the world = single-process norm^2)."""
        terms = []
        for owner, b, g, lo in self._synced():
            if not owner:
                continue
            hi = lo + g.size
            for p, off, size in zip(b.params, b.offsets, b.sizes):
                a, e = max(off, lo), min(off + size, hi)
                if a < e and self._counts[id(p)]:
                    terms.append(sum_sq(g[a - lo:e - lo]))
        sq = 0.0
        for t in host_scalars(terms):                 # one device->host copy on a GPU
            sq += float(t)
        return sq

    def nonfinite(self) -> int:
        """Number of synced buckets (or chunks) here holding an inf or nan."""
        return sum(0 if xp_of(g).isfinite(g).all() else 1 for _, _, g, _ in self._synced())

    def step(self, optimizer, lr, clip, total_sq: float) -> float:
        """Clip every gradient by the global norm sqrt(total_sq) and update; returns the norm."""
        fixed = (lambda _sq: total_sq)            # the sum over the mesh is already done
        if not self.zero:
            norm = clip_grad_norm(self.params, clip, fixed)
            optimizer.step(lr)
            return norm
        norm = float("nan")
        for d in self.syncs:                      # each updates its chunks, allgathers its params
            norm = d.step(optimizer, lr=lr, clip=clip, allreduce_sq=fixed)
        return norm

    def export_optimizer_state(self, optimizer):
        for d in self.syncs:
            d.export_optimizer_state(optimizer)

    def import_optimizer_state(self, optimizer):
        for d in self.syncs:
            d.import_optimizer_state(optimizer)

    def stats(self):
        return [d.stats() for d in self.syncs]

    def memory_report(self):
        return [d.memory_report() for d in self.syncs]
