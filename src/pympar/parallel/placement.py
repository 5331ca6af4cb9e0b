"""Where each parameter lives on the process mesh, and what follows from it.

A ``Placement`` says, for one Parameter of this rank, per mesh axis:

    tp     "shard": each tp rank holds a distinct part (its ``.shard``); "replicate": all the same
    group  "dp": replicated over the data-parallel group; "edp": an expert, held by one ep rank of
           each ep group and replicated over the expert-data-parallel group (pympar.parallel.ep)
    pp     owned by the stage that built it; ``tied_copy``: the last stage's copy of stage 0's wte
    zero   the ZeRO stage and ``rows``, the rows of dim 0 of the tp-local tensor this rank keeps
           (of the optimizer state from stage 1, of the gradient from 2, of the weights at 3)

From it: which group reduces the gradient and how (``grad_scale``: the mean over dp, or the
sum over edp / dp for experts), and which rank counts each gradient element in the global norm
(``counts_in_norm``: every element exactly once over the world).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    tp: str = "replicate"
    group: str = "dp"
    tied_copy: bool = False
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
        s = f"tp={self.tp} {self.group}" + (" tied-copy" if self.tied_copy else "")
        return s + (f" zero{self.zero} rows={self.rows}" if self.zero else "")
