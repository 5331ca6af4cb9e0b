"""The process mesh: world = pp x dp x cp x tp, experts sharded over the data- and
context-parallel ranks.

Layout (the rank of coordinates (pp_rank, dp_rank, cp_rank, tp_rank)):

    ranks = arange(world).reshape(pp, dp, cp, tp)
    rank  = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

so the tp ranks of a group are adjacent (one node, given ranks are placed node by node), the
cp ranks next (same node first), and each pipeline stage is a contiguous block of dp*cp*tp
ranks. The dp and cp axes together form the gradient group (``dpcp``, of size dp*cp, rank
dpcp_rank = dp_rank*cp + cp_rank): every replicated gradient is averaged over it, and ZeRO
shards over it (as Megatron's data-parallel group "with context parallel"). Expert parallelism
splits that axis: ep_rank = dpcp_rank % ep (ep consecutive ranks of it hold different
experts), and the expert-data-parallel group (edp, the ranks holding the same experts) is the
dpcp ranks with equal ep_rank, of size dp*cp // ep. With cp = 1 these are the dp ranks.

Example, world 8 = pp 2 x dp 2 x tp 2:
    stage 0: ranks 0..3, tp groups [0,1] [2,3], dp groups [0,2] [1,3]
    stage 1: ranks 4..7, pp groups [0,4] [1,5] [2,6] [3,7]
World 8 = dp 2 x cp 2 x tp 2: tp [0,1] [2,3] [4,5] [6,7]; cp [0,2] [1,3] [4,6] [5,7];
dp [0,4] [1,5] [2,6] [3,7]; dpcp [0,2,4,6] [1,3,5,7].
"""
from __future__ import annotations

import warnings
from typing import NamedTuple

import numpy as np

from ..comm import SelfComm


class Coords(NamedTuple):
    pp: int
    dp: int
    cp: int
    tp: int


def divisors(n: int) -> list:
    """The divisors of n, ascending (the sizes a mesh axis of n ranks can take)."""
    return [d for d in range(1, n + 1) if n % d == 0]


class Mesh:
    """Mesh(comm, dp=, pp=, tp=, ep=, cp=): sub-communicators of a Communicator (or mpi4py comm)."""

    @staticmethod
    def validate(world: int, dp: int = 1, pp: int = 1, tp: int = 1, ep: int = 1, cp: int = 1) -> None:
        """Raise ValueError unless world == pp*dp*cp*tp and ep divides dp*cp (no communication)."""
        for name, v in (("dp", dp), ("pp", pp), ("tp", tp), ("ep", ep), ("cp", cp)):
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if dp * pp * cp * tp != world:
            what = f"dp*pp*tp = {dp}*{pp}*{tp}" if cp == 1 else f"dp*pp*cp*tp = {dp}*{pp}*{cp}*{tp}"
            raise ValueError(f"world size {world} != {what} = {dp * pp * cp * tp}: "
                             f"launch {dp * pp * cp * tp} ranks or choose sizes whose product is {world}")
        if (dp * cp) % ep:
            over = f"dp={dp}" if cp == 1 else f"dp*cp={dp * cp}"
            raise ValueError(f"ep={ep} does not divide {over}: experts are sharded over the data-"
                             f"{'parallel' if cp == 1 else ' and context-parallel'} ranks, so ep must be one of "
                             f"{divisors(dp * cp)}")

    @staticmethod
    def coords(rank: int, dp: int = 1, pp: int = 1, tp: int = 1, cp: int = 1) -> Coords:
        """(pp, dp, cp, tp) coordinates of a rank in the layout above."""
        return Coords(rank // (dp * cp * tp), (rank // (cp * tp)) % dp, (rank // tp) % cp, rank % tp)

    @staticmethod
    def groups(world: int, dp: int = 1, pp: int = 1, tp: int = 1, ep: int = 1, cp: int = 1):
        """Every group of each kind as lists of ranks (pure; the tests' oracle)."""
        Mesh.validate(world, dp, pp, tp, ep, cp)
        g = np.arange(world).reshape(pp, dp, cp, tp)
        dc = g.reshape(pp, dp * cp, tp)                      # the dpcp axis: index d*cp + c
        n = dp * cp
        return {
            "tp": [g[p, d, c, :].tolist() for p in range(pp) for d in range(dp) for c in range(cp)],
            "cp": [g[p, d, :, t].tolist() for p in range(pp) for d in range(dp) for t in range(tp)],
            "dp": [g[p, :, c, t].tolist() for p in range(pp) for c in range(cp) for t in range(tp)],
            "dpcp": [dc[p, :, t].tolist() for p in range(pp) for t in range(tp)],
            "pp": [g[:, d, c, t].tolist() for d in range(dp) for c in range(cp) for t in range(tp)],
            "ep": [dc[p, e * ep:(e + 1) * ep, t].tolist() for p in range(pp) for t in range(tp) for e in range(n // ep)],
            "edp": [dc[p, k::ep, t].tolist() for p in range(pp) for t in range(tp) for k in range(ep)],
        }

    def __init__(self, comm=None, dp: int = 1, pp: int = 1, tp: int = 1, ep: int = 1, cp: int = 1):
        comm = _as_communicator(comm)
        self.validate(comm.size, dp, pp, tp, ep, cp)  # every rank, before any collective
        self.comm, self.dp, self.pp, self.tp, self.ep, self.cp = comm, dp, pp, tp, ep, cp
        self.dpcp = dp * cp
        self.edp = self.dpcp // ep
        r = comm.rank
        self.pp_rank, self.dp_rank, self.cp_rank, self.tp_rank = self.coords(r, dp, pp, tp, cp)
        p, d, c, t = self.pp_rank, self.dp_rank, self.cp_rank, self.tp_rank
        self.dpcp_rank = d * cp + c
        self.ep_rank, self.edp_rank = self.dpcp_rank % ep, self.dpcp_rank // ep
        n = comm.name
        # split keys are the rank order inside each group (the coordinate along that axis)
        self.tp_comm = comm.split((p * dp + d) * cp + c, key=t, name=f"{n}/tp{p}.{d}.{c}" if cp > 1 else f"{n}/tp{p}.{d}")
        self.dp_comm = comm.split((p * cp + c) * tp + t, key=d, name=f"{n}/dp{p}.{c}.{t}" if cp > 1 else f"{n}/dp{p}.{t}")
        self.pp_comm = comm.split((d * cp + c) * tp + t, key=p, name=f"{n}/pp{d}.{c}.{t}" if cp > 1 else f"{n}/pp{d}.{t}")
        if cp > 1:
            self.cp_comm = comm.split((p * dp + d) * tp + t, key=c, name=f"{n}/cp{p}.{d}.{t}")
            self.dpcp_comm = comm.split(p * tp + t, key=self.dpcp_rank, name=f"{n}/dpcp{p}.{t}")
        else:                                   # the same groups: no second communicator
            self.cp_comm, self.dpcp_comm = SelfComm(), self.dp_comm
        self.ep_comm = comm.split((p * tp + t) * self.edp + self.edp_rank, key=self.ep_rank,
                                  name=f"{n}/ep{p}.{t}.{self.edp_rank}")
        self.edp_comm = comm.split((p * tp + t) * ep + self.ep_rank, key=self.edp_rank,
                                   name=f"{n}/edp{p}.{t}.{self.ep_rank}")
        self.prev_stage = self.rank_of(p - 1, d, t, c) if p > 0 else None
        self.next_stage = self.rank_of(p + 1, d, t, c) if p < pp - 1 else None
        self._check_tp_in_node()

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def communicators(self):
        """Every distinct sub-communicator this mesh made (to free them)."""
        out = []
        for c in (self.tp_comm, self.dp_comm, self.pp_comm, self.cp_comm, self.dpcp_comm, self.ep_comm,
                  self.edp_comm):
            if all(c is not o for o in out):
                out.append(c)
        return out

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
        return (f"Mesh(world={self.comm.size}, dp={self.dp}, pp={self.pp}, cp={self.cp}, tp={self.tp}, ep={self.ep}; "
                f"rank {self.comm.rank} = pp {self.pp_rank}, dp {self.dp_rank}, cp {self.cp_rank}, tp {self.tp_rank}, "
                f"ep {self.ep_rank})")


def _as_communicator(comm):
    if comm is None:
        return SelfComm()
    if hasattr(comm, "allreduce") and hasattr(comm, "split") and hasattr(comm, "rank") and not hasattr(comm, "Get_rank"):
        return comm
    from ..comm.mpi import MPIComm   # an mpi4py communicator

    return MPIComm(comm)
