"""Gradient synchronisation of a composed (dp, pp, tp, ep) layout, and its global norm.

What each rank holds after backward (the pipeline executor has already summed the tied
wte between the first and last stage, and the sequence-parallel partial grads over tp):

    dense params   (1/n_micro) * sum over THIS rank's micro-batches     -> mean over dp
    expert params  (1/n_micro) * sum over its ep group's micro-batches  -> mean over edp, x edp/(dp*cp)
                   (1/ep unless the experts are folded apart from tp: mesh.expert_grad_scale)

(see pympar.parallel.ep for the 1/ep). Each kind is one ``DataParallel`` (buckets overlapped
with backward, optional ZeRO-1/2/3 and compression) over its group: dense over ``mesh.dpcp_comm``
(the dp group, or dp x cp under context parallelism),
expert over ``mesh.edp_comm``. With ZeRO the state (rows) of expert parameters is
therefore sharded over edp and that of dense parameters over dp.

Overlap under a pipeline: the executor calls ``begin_final(params)`` as the last micro-batch's
backward of each chunk begins, so a bucket starts as soon as its parameters' grads are final,
during the backward of the other chunks and the pipeline's drain, as DP alone does in its last
micro-batch. The tied wte copy's gradient is final only after the first/last-stage sum at the
end of the step (its grad_ready comes then), so its bucket starts after all the others.

Placement. Each parameter's ``placement`` (pympar.parallel.placement) was set by the steps that
made the model: tp shard or replica (its ``.shard``), the edp group for the experts (expert
parallelism, folded experts), partial over tp or pp (sequence parallelism, the tied wte) and the
last stage's tied copy; its data-parallel bucket gives it the ZeRO stage and rows. Everything
below derives from it -- the group that reduces its gradient, which bucket starts last (the tied
copy), and who counts it in the global norm: one sum over the world of every rank's
``local_sq()`` is the single-process norm^2.
"""
from __future__ import annotations


import numpy as np

from ..backend import xp_of
from ..comm.exact import ExactSum
from ..optim import AdamW
from ..optim.clip import sum_of_squares
from .dp import DataParallel, clip_and_update
from .placement import param_placement
from .zero import NoGather, ZeroAdamW, install_gather


class GradSync:
    """Dense grads mean over dp, expert grads over edp (x 1/ep); the norm over the whole mesh.

    named: the rank's (global name, Parameter), placed by the steps that made them; mesh:
    pympar.parallel.mesh.Mesh; dp_kw:
    DataParallel's bucket_mb, overlap, compress, zero, units. Per step: begin_step(),
    begin_micro(last) before each micro-batch (or once with last=False under a pipeline, whose
    executor then calls begin_final(params) per chunk), finish(), then local_sq()/nonfinite()
    and step(optimizer, lr, clip, total_sq) with the optimizer of make_optimizer().
    """

    def __init__(self, named, mesh, **dp_kw):
        self.zero = int(dp_kw.get("zero", 0))
        self.mesh = mesh
        named = list(named)
        dense = [(n, p) for n, p in named if param_placement(p).group == "dp"]
        expert = [(n, p) for n, p in named if param_placement(p).group == "edp"]
        self.named, self.params = named, [p for _, p in named]
        # (DataParallel, post-scale, group rank): the dp (edp) rank 0 counts replicated grads
        late = [p for _, p in named if param_placement(p).tied_copy]     # final after the tied sum only
        self.groups = [(DataParallel(dense, mesh.dpcp_comm, launch_last=late, **dp_kw), 1.0, mesh.dpcp_rank)]
        if expert:
            self.groups.append((DataParallel(expert, mesh.edp_comm, **dp_kw), mesh.expert_grad_scale, mesh.edp_rank))
        self.grad_bytes = sum(d.grad_bytes for d, _, _ in self.groups)
        # an expert's tensor-parallel rank is its etp rank (the tp rank unless folded: parallel.mesh)
        self._counts = {id(p): p.placement.counts_in_norm(mesh.etp_rank if p.placement.group == "edp" else mesh.tp_rank,
                                                          grank)
                        for d, _, grank in self.groups for p in (q for _, q in d.named)}
        self.gather = NoGather()


    def counts_in_norm(self, p) -> bool:
        """Does this rank count p's synced gradient in the global norm (placement.counts_in_norm)?"""
        return self._counts[id(p)]

    @property
    def syncs(self):
        return [d for d, _, _ in self.groups]

    def attach(self, model):
        """Backward notifications to every group's sync; ZeRO-3: one ParamGather over all groups
        (a MoE block's experts are in the edp group's buckets) as the model's parameter scope."""
        for d in self.syncs:
            d.attach(model)
        if self.zero == 3:
            self.gather = install_gather(model, self.syncs)
        return self

    def begin_step(self):
        for d in self.syncs:
            d.begin_step()

    def begin_micro(self, last: bool):
        for d in self.syncs:
            d.begin_micro(last)

    def add_micro(self):
        """exact (--deterministic): this micro-batch's gradients become one term of the exact sums."""
        for d in self.syncs:
            d.add_micro()

    def exact_sum_of(self, p):
        """exact: p's ExactSum of this step, from the group that reduces it."""
        for d in self.syncs:
            if id(p) in d.bucket_of:
                return d.exact_sum_of(p)
        raise KeyError(f"{p!r} is in no gradient group")

    def exact_sq(self, world) -> float:
        """exact: the squared global norm summed exactly over every rank of ``world`` (each counts
        what counts_in_norm gives it): the same bits however the gradients are sharded."""
        acc = ExactSum((), np.float64)
        for d in self.syncs:
            acc.merge(d.exact_local_sq(self.counts_in_norm))
        return float(acc.allreduce(world).value())

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

    def named_grads(self):
        """(name, synced gradient this rank holds): the full mean, or its ZeRO rows."""
        names = {id(p): n for n, p in self.named}
        for d in self.syncs:
            for p, g in d.held_grads():
                yield names[id(p)], g

    def local_sq(self) -> float:
        """This rank's share of the squared global norm (sum over the world = single-process norm^2)."""
        return sum_of_squares([g for d in self.syncs for p, g in d.held_grads() if self._counts[id(p)]])

    def nonfinite(self) -> int:
        """Number of synced gradients (or ZeRO rows) held here with an inf or nan."""
        return sum(0 if xp_of(g).isfinite(g).all() else 1 for _, g in self.named_grads() if g.size)

    def make_optimizer(self, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, moments_dtype=None):
        """AdamW over the full parameters (zero=0), or ZeroAdamW over this rank's rows (ZeRO):
        optimizer state exists only for what this rank updates; moments_dtype 'bfloat16': bf16 moments."""
        if not self.zero:
            return AdamW(self.named, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         moments_dtype=moments_dtype)
        pieces = [x for d in self.syncs for x in d.optimizer_pieces()]
        return ZeroAdamW(pieces, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, moments_dtype=moments_dtype)

    def step(self, optimizer, lr, clip, total_sq: float) -> float:
        """Clip every gradient by the global norm sqrt(total_sq) and update; returns the norm."""
        return clip_and_update(self.syncs, optimizer, lr, clip, total_sq)

    def stats(self):
        return [d.stats() for d in self.syncs]
