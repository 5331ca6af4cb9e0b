"""Where each parameter lives on the process mesh, and what follows from it.

A ``Placement`` says, for one Parameter of this rank, per mesh axis:

    tp     "shard": each tp rank holds a distinct part (its ``.shard``); "replicate": all the same
    group  "dp": replicated over the data-parallel group; "edp": an expert, held by one ep rank of
           each ep group and replicated over the expert-data-parallel group (pympar.parallel.ep)
    pp     owned by the stage that built it; ``tied_copy``: the last stage's copy of stage 0's wte
    partial  the axes over which this rank's gradient is only a part, summed before the group's
           reduction: "tp" (a replicated parameter that saw only this rank's positions under
           sequence parallelism), "pp" (the wte tied between the first and the last stage)
    zero   the ZeRO stage and ``rows``, the rows of dim 0 of the tp-local tensor this rank keeps
           (of the optimizer state from stage 1, of the gradient from 2, of the weights at 3)

Each field is set by the step that makes it so, when it does: tensor parallelism shards a
parameter (its ``.shard``) and marks its sequence-parallel partials (parallel.tp), expert
parallelism or folded experts put the experts in the edp group (parallel.ep, parallel.tp.moe),
the pipeline marks the tied wte (parallel.pp.stage), the data-parallel buckets the ZeRO stage
and the rows a rank keeps (parallel.dp, parallel.zero). From it
follow which group reduces the gradient and how (the mean over dp, or the sum over edp / dp for
experts: parallel.gradsync), which parameters the tp and tied sums take, which gradients are
final only after them (nn.gpt.GradReadyHooks' later_grad_ids), and which rank counts each
gradient element in the global norm (``counts_in_norm``: every element exactly once over the world).
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Placement:
    tp: str = "replicate"
    group: str = "dp"
    tied_copy: bool = False
    partial: tuple = ()
    zero: int = 0
    rows: tuple | None = None

    def counts_in_norm(self, tp_rank: int, group_rank: int) -> bool:
        """Does this rank count its (synced) gradient of the parameter in the global norm?"""
        if self.tied_copy:
            return False                          # stage 0 counts the tied wte
        if self.tp == "replicate" and tp_rank != 0:
            return False
        return bool(self.zero) or group_rank == 0  # ZeRO: every rank its rows; else one replica

    def describe(self) -> str:
        s = f"tp={self.tp} {self.group}" + (" tied-copy" if self.tied_copy else "") + \
            "".join(f" partial-{a}" for a in self.partial)
        return s + (f" zero{self.zero} rows={self.rows}" if self.zero else "")


def param_placement(p) -> Placement:
    """p's placement: what the parallel steps set, tp from its ``.shard`` where none has been set."""
    return p.placement if p.placement is not None else Placement(tp="shard" if p.shard is not None else "replicate")


def place(params, **fields) -> None:
    """Set these fields of each parameter's placement (a parallel step marking what it made so)."""
    for p in params:
        p.placement = replace(param_placement(p), **fields)


def partial_over(params, axis: str) -> list:
    """The parameters whose gradient is a partial sum over ``axis`` ("tp" or "pp"), each once."""
    out, seen = [], set()
    for p in params:
        if id(p) not in seen and axis in param_placement(p).partial:
            seen.add(id(p))
            out.append(p)
    return out
