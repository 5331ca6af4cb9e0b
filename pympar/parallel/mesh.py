"""The process mesh: world = pp x dp x tp, experts sharded over data-parallel ranks.

Layout (the rank of coordinates (pp_rank, dp_rank, tp_rank)):

    ranks = arange(world).reshape(pp, dp, tp)
    rank  = (pp_rank * dp + dp_rank) * tp + tp_rank

so the tp ranks of a group are adjacent (one node, given ranks are placed node by node)
and each pipeline stage is a contiguous block of dp*tp ranks. Expert parallelism splits
the dp axis: ep_rank = dp_rank % ep (ep consecutive dp ranks hold different experts),
and the expert-data-parallel group (edp, the ranks holding the same experts) is the
dp ranks with equal ep_rank, of size dp // ep.

Example, world 8 = pp 2 x dp 2 x tp 2:
    stage 0: ranks 0..3, tp groups [0,1] [2,3], dp groups [0,2] [1,3]
    stage 1: ranks 4..7, pp groups [0,4] [1,5] [2,6] [3,7]
"""
from __future__ import annotations

import warnings

import numpy as np

from ..comm import SelfComm


class Mesh:
    """Mesh(comm, dp=, pp=, tp=, ep=): sub-communicators of a Communicator (or mpi4py comm)."""

    @staticmethod
    def validate(world: int, dp: int = 1, pp: int = 1, tp: int = 1, ep: int = 1) -> None:
        """Raise ValueError unless world == dp*pp*tp and ep divides dp (no communication)."""
        for name, v in (("dp", dp), ("pp", pp), ("tp", tp), ("ep", ep)):
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if dp * pp * tp != world:
            raise ValueError(f"world size {world} != dp*pp*tp = {dp}*{pp}*{tp} = {dp * pp * tp}: "
                             f"launch {dp * pp * tp} ranks or choose sizes whose product is {world}")
        if dp % ep:
            raise ValueError(f"ep={ep} does not divide dp={dp}: experts are sharded over data-parallel "
                             f"ranks, so ep must be one of {[d for d in range(1, dp + 1) if dp % d == 0]}")

    @staticmethod
    def coords(rank: int, dp: int = 1, pp: int = 1, tp: int = 1):
        """(pp_rank, dp_rank, tp_rank) of a rank in the layout above."""
        return rank // (dp * tp), (rank // tp) % dp, rank % tp

    @staticmethod
    def groups(world: int, dp: int = 1, pp: int = 1, tp: int = 1, ep: int = 1):
        """Every group of each kind as lists of ranks (pure; the tests' oracle)."""
        Mesh.validate(world, dp, pp, tp, ep)
        g = np.arange(world).reshape(pp, dp, tp)
        out = {
            "tp": [g[p, d, :].tolist() for p in range(pp) for d in range(dp)],
            "dp": [g[p, :, t].tolist() for p in range(pp) for t in range(tp)],
            "pp": [g[:, d, t].tolist() for d in range(dp) for t in range(tp)],
            "ep": [g[p, e * ep:(e + 1) * ep, t].tolist() for p in range(pp) for t in range(tp) for e in range(dp // ep)],
            "edp": [g[p, k::ep, t].tolist() for p in range(pp) for t in range(tp) for k in range(ep)],
        }
        return out

    def __init__(self, comm=None, dp: int = 1, pp: int = 1, tp: int = 1, ep: int = 1):
        comm = _as_communicator(comm)
        self.validate(comm.size, dp, pp, tp, ep)  # every rank, before any collective
        self.comm, self.dp, self.pp, self.tp, self.ep = comm, dp, pp, tp, ep
        self.edp = dp // ep
        r = comm.rank
        self.pp_rank, self.dp_rank, self.tp_rank = self.coords(r, dp, pp, tp)
        self.ep_rank, self.edp_rank = self.dp_rank % ep, self.dp_rank // ep
        p, d, t = self.pp_rank, self.dp_rank, self.tp_rank
        # split keys are the rank order inside each group (the coordinate along that axis)
        self.tp_comm = comm.split(p * dp + d, key=t, name=f"{comm.name}/tp{p}.{d}")
        self.dp_comm = comm.split(p * tp + t, key=d, name=f"{comm.name}/dp{p}.{t}")
        self.pp_comm = comm.split(d * tp + t, key=p, name=f"{comm.name}/pp{d}.{t}")
        self.ep_comm = comm.split((p * tp + t) * self.edp + self.edp_rank, key=self.ep_rank,
                                  name=f"{comm.name}/ep{p}.{t}.{self.edp_rank}")
        self.edp_comm = comm.split((p * tp + t) * ep + self.ep_rank, key=self.edp_rank,
                                   name=f"{comm.name}/edp{p}.{t}.{self.ep_rank}")
        self.prev_stage = self.rank_of(p - 1, d, t) if p > 0 else None
        self.next_stage = self.rank_of(p + 1, d, t) if p < pp - 1 else None
        self._check_tp_in_node()

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def _check_tp_in_node(self):
        """Warn (rank 0 of the group) when a tensor-parallel group crosses nodes."""
        if self.tp == 1 or not hasattr(self.comm, "topology"):
            return
        topo = self.comm.topology()
        if topo.single_node:
            return
        leader = np.array([topo.node_to_comm[0]], dtype=np.int64)
        nodes = self.tp_comm.allgather(leader, algo="mpi")
        if len(set(nodes.tolist())) > 1 and self.tp_rank == 0:
            warnings.warn(f"tensor-parallel group of rank {self.comm.rank} spans {len(set(nodes.tolist()))} nodes: "
                          f"place tp={self.tp} ranks within a node (ranks per node should be a multiple of tp)")

    def __repr__(self):
        return (f"Mesh(world={self.comm.size}, dp={self.dp}, pp={self.pp}, tp={self.tp}, ep={self.ep}; "
                f"rank {self.comm.rank} = pp {self.pp_rank}, dp {self.dp_rank}, tp {self.tp_rank}, ep {self.ep_rank})")


def _as_communicator(comm):
    if comm is None:
        return SelfComm()
    if hasattr(comm, "allreduce") and hasattr(comm, "split") and hasattr(comm, "rank") and not hasattr(comm, "Get_rank"):
        return comm
    from ..comm.mpi import MPIComm   # an mpi4py communicator

    return MPIComm(comm)
