"""The process mesh: world = pp x dp x cp x tp for attention and the dense layers, and over the
same ranks the experts' own grid, etp x ep x edp (parallel folding, as Megatron-Core's).

Layout (the rank of coordinates (pp_rank, dp_rank, cp_rank, tp_rank)):

    ranks = arange(world).reshape(pp, dp, cp, tp)
    rank  = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

so the tp ranks of a group are adjacent (one node, given ranks are placed node by node), the
cp ranks next (same node first), and each pipeline stage is a contiguous block of dp*cp*tp
ranks. The dp and cp axes together form the gradient group (``dpcp``, of size dp*cp, rank
dpcp_rank = dp_rank*cp + cp_rank): every replicated gradient is averaged over it, and ZeRO
shards over it (as Megatron's data-parallel group "with context parallel").

The experts' grid. A pipeline stage's dp*cp*tp ranks, numbered s = dpcp_rank * tp + tp_rank
(their order in the world), are also etp x ep x edp with etp fastest:

    etp_rank = s % etp,  ep_rank = (s // etp) % ep,  edp_rank = s // (etp * ep)

etp (expert tensor parallelism, a divisor of tp; default tp) splits each expert's hidden width;
ep ranks hold different experts; edp ranks hold the same ones. With etp = tp (unfolded, the
default) this is the older rule: ep_rank = dpcp_rank % ep, ep divides dp*cp, experts sharded
like the dense MLP. With etp < tp (folded) the tp group's ranks, which route the same tokens,
split those tokens' expert rows into tp/etp shares (``fold_comm``, fold_rank = tp_rank // etp),
and ep may reach over tp ranks: ep divides dp*cp*tp/etp. An expert's gradient is summed over edp
and scaled by ``expert_grad_scale`` = edp / (dp*cp) (each of the dp*cp micro-batch streams
reaches every expert once, through one edp rank).

Example, world 8 = pp 2 x dp 2 x tp 2:
    stage 0: ranks 0..3, tp groups [0,1] [2,3], dp groups [0,2] [1,3]
    stage 1: ranks 4..7, pp groups [0,4] [1,5] [2,6] [3,7]
World 8 = dp 2 x cp 2 x tp 2: tp [0,1] [2,3] [4,5] [6,7]; cp [0,2] [1,3] [4,6] [5,7];
dp [0,4] [1,5] [2,6] [3,7]; dpcp [0,2,4,6] [1,3,5,7].
World 8 = dp 4 x tp 2, ep 8, etp 1 (folded): ep [0..7], edp [0] .. [7], fold = tp [0,1] ...;
with ep 4, etp 1: ep [0,1,2,3] [4,5,6,7], edp [0,4] [1,5] [2,6] [3,7].
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
    def validate(world: int, dp: int = 1, pp: int = 1, tp: int = 1, ep: int = 1, cp: int = 1, etp=None) -> None:
        """Raise ValueError unless world == pp*dp*cp*tp, etp divides tp and ep divides dp*cp*tp/etp
        (no communication)."""
        etp = tp if etp is None else etp
        for name, v in (("dp", dp), ("pp", pp), ("tp", tp), ("ep", ep), ("cp", cp), ("etp", etp)):
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if dp * pp * cp * tp != world:
            what = f"dp*pp*tp = {dp}*{pp}*{tp}" if cp == 1 else f"dp*pp*cp*tp = {dp}*{pp}*{cp}*{tp}"
            raise ValueError(f"world size {world} != {what} = {dp * pp * cp * tp}: "
                             f"launch {dp * pp * cp * tp} ranks or choose sizes whose product is {world}")
        if tp % etp:
            raise ValueError(f"etp={etp} does not divide tp={tp}: expert tensor parallelism splits a tensor-parallel "
                             f"group, so etp must be one of {divisors(tp)}")
        if (dp * cp * (tp // etp)) % ep:
            over = f"dp={dp}" if cp == 1 else f"dp*cp={dp * cp}"
            if etp < tp:
                over = f"dp*cp*tp/etp={dp * cp * tp // etp}"
            raise ValueError(f"ep={ep} does not divide {over}: experts are sharded over the data-"
                             f"{'parallel' if cp == 1 else ' and context-parallel'} ranks"
                             f"{' and the folded tensor-parallel ones' if etp < tp else ''}, so ep must be one of "
                             f"{divisors(dp * cp * (tp // etp))}"
                             + ("" if etp < tp or tp == 1 else " (or fold the experts apart: --etp 1 lets ep reach over tp)"))

    @staticmethod
    def coords(rank: int, dp: int = 1, pp: int = 1, tp: int = 1, cp: int = 1) -> Coords:
        """(pp, dp, cp, tp) coordinates of a rank in the layout above."""
        return Coords(rank // (dp * cp * tp), (rank // (cp * tp)) % dp, (rank // tp) % cp, rank % tp)

    @staticmethod
    def groups(world: int, dp: int = 1, pp: int = 1, tp: int = 1, ep: int = 1, cp: int = 1, etp=None):
        """Every group of each kind as lists of ranks (pure; the tests' oracle)."""
        Mesh.validate(world, dp, pp, tp, ep, cp, etp)
        etp = tp if etp is None else etp
        g = np.arange(world).reshape(pp, dp, cp, tp)
        dc = g.reshape(pp, dp * cp, tp)                      # the dpcp axis: index d*cp + c
        xg = g.reshape(pp, -1, ep, etp)                      # the experts' grid: (pp, edp, ep, etp)
        stage = dp * cp * tp
        return {
            "tp": [g[p, d, c, :].tolist() for p in range(pp) for d in range(dp) for c in range(cp)],
            "cp": [g[p, d, :, t].tolist() for p in range(pp) for d in range(dp) for t in range(tp)],
            "dp": [g[p, :, c, t].tolist() for p in range(pp) for c in range(cp) for t in range(tp)],
            "dpcp": [dc[p, :, t].tolist() for p in range(pp) for t in range(tp)],
            "pp": [g[:, d, c, t].tolist() for d in range(dp) for c in range(cp) for t in range(tp)],
            "ep": [xg[p, e, :, t].tolist() for p in range(pp) for t in range(etp) for e in range(stage // (ep * etp))],
            "edp": [xg[p, :, k, t].tolist() for p in range(pp) for t in range(etp) for k in range(ep)],
            "etp": [xg[p, e, k, :].tolist() for p in range(pp) for e in range(stage // (ep * etp)) for k in range(ep)],
            "fold": [dc[p, d, t::etp].tolist() for p in range(pp) for d in range(dp * cp) for t in range(etp)],
        }

    def __init__(self, comm=None, dp: int = 1, pp: int = 1, tp: int = 1, ep: int = 1, cp: int = 1, etp=None):
        comm = _as_communicator(comm)
        self.validate(comm.size, dp, pp, tp, ep, cp, etp)  # every rank, before any collective
        etp = tp if etp is None else etp
        self.comm, self.dp, self.pp, self.tp, self.ep, self.cp, self.etp = comm, dp, pp, tp, ep, cp, etp
        self.dpcp = dp * cp
        self.fold = tp // etp                          # shares of a tp group's expert rows (1: unfolded)
        self.edp = self.dpcp * self.fold // ep
        self.expert_grad_scale = self.edp / self.dpcp  # on the edp mean of an expert gradient: the edp sum / (dp*cp)
        r = comm.rank
        self.pp_rank, self.dp_rank, self.cp_rank, self.tp_rank = self.coords(r, dp, pp, tp, cp)
        p, d, c, t = self.pp_rank, self.dp_rank, self.cp_rank, self.tp_rank
        self.dpcp_rank = d * cp + c
        s = self.dpcp_rank * tp + t                    # this rank in its stage; the experts' grid below
        self.etp_rank, self.ep_rank, self.edp_rank = s % etp, (s // etp) % ep, s // (etp * ep)
        self.fold_rank = t // etp
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
        et, ed, ee = self.etp_rank, self.edp_rank, self.ep_rank
        self.ep_comm = comm.split((p * etp + et) * self.edp + ed, key=ee, name=f"{n}/ep{p}.{et}.{ed}")
        self.edp_comm = comm.split((p * etp + et) * ep + ee, key=ed, name=f"{n}/edp{p}.{et}.{ee}")
        if etp == tp:                            # unfolded: the experts' tp group is the tp group
            self.etp_comm, self.fold_comm = self.tp_comm, SelfComm()
        else:
            self.etp_comm = SelfComm() if etp == 1 else comm.split((p * self.edp + ed) * ep + ee, key=et,
                                                                   name=f"{n}/etp{p}.{ed}.{ee}")
            self.fold_comm = comm.split((p * self.dpcp + self.dpcp_rank) * etp + et, key=self.fold_rank,
                                        name=f"{n}/fold{p}.{self.dpcp_rank}.{et}")
        self.prev_stage = self.rank_of(p - 1, d, t, c) if p > 0 else None
        self.next_stage = self.rank_of(p + 1, d, t, c) if p < pp - 1 else None
        self._check_tp_in_node()

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def communicators(self):
        """Every distinct sub-communicator this mesh made (to free them)."""
        out = []
        for c in (self.tp_comm, self.dp_comm, self.pp_comm, self.cp_comm, self.dpcp_comm, self.ep_comm,
                  self.edp_comm, self.etp_comm, self.fold_comm):
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
                f"ep {self.ep_rank}" + (f"; experts folded: etp={self.etp}, etp rank {self.etp_rank}" if self.fold > 1 else "")
                + ")")


def _as_communicator(comm):
    if comm is None:
        return SelfComm()
    if hasattr(comm, "allreduce") and hasattr(comm, "split") and hasattr(comm, "rank") and not hasattr(comm, "Get_rank"):
        return comm
    from ..comm.mpi import MPIComm   # an mpi4py communicator

    return MPIComm(comm)
