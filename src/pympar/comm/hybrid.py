"""DeviceComm: one communicator for a GPU job -- CuPy operands over NCCL, host operands over MPI.

A GPU trainer moves two kinds of data: gradients and activations (CuPy arrays, which NCCL
moves device to device) and small host vectors (the step's loss and norm, parameter counts,
evaluation totals, MoE loads) that NCCL does not take. ``DeviceComm(nccl_comm)`` routes each
call by its operand: CuPy -> the NCCLComm, anything else -> the MPIComm that the NCCLComm
was bootstrapped on. ``split`` splits both, so a Mesh built on a DeviceComm hands out
DeviceComm groups (dp, tp, pp, ep, edp), each with its own NCCL communicator.

Without NCCL (``DeviceComm.mpi_only(mpi_comm)``) every call goes to the MPIComm. The MPI side is
always behind a ``HostStaging`` wrapper (pympar.comm.staging): CuPy operands that reach it (all
of them without NCCL; with NCCL, e.g. the pipeline's tagged sends under --pp-channels tags) go
through host copies, or as device pointers to a CUDA-aware MPI (pympar.comm.device.cuda_aware_mpi).
"""
from __future__ import annotations

from .. import backend

# verbs whose first operand decides the route (everything else, barrier included, goes to MPI)
_ROUTED = ("allreduce", "iallreduce", "reduce_scatter", "ireduce_scatter", "allgather", "iallgather",
           "broadcast", "ibroadcast", "alltoall", "ialltoall", "alltoallv", "ialltoallv",
           "send", "recv", "isend", "irecv", "sendrecv", "isendrecv")


class DeviceComm:
    def __init__(self, nccl_comm=None, mpi_comm=None):
        if nccl_comm is None and mpi_comm is None:
            raise ValueError("DeviceComm needs an NCCLComm or an MPIComm")
        from .staging import HostStaging

        self.nccl = nccl_comm
        # the MPI side: host vectors, and device operands NCCL is not given (the pipeline's tagged
        # sends with --pp-channels tags) -- staged through the host unless MPI is CUDA-aware
        mpi = mpi_comm if mpi_comm is not None else nccl_comm.mpi
        self.mpi = mpi if isinstance(mpi, HostStaging) else HostStaging(mpi)
        self.rank, self.size = self.mpi.rank, self.mpi.size
        self.name = nccl_comm.name if nccl_comm is not None else self.mpi.name
        self.timeout = self.mpi.timeout

    @classmethod
    def mpi_only(cls, mpi_comm):
        return cls(None, mpi_comm)

    @property
    def mpi_comm(self):
        """The mpi4py communicator underneath (object collectives: gather of state dicts)."""
        return self.mpi.mpi_comm

    @property
    def uses_nccl(self) -> bool:
        return self.nccl is not None

    def _route(self, verb, args, kwargs):
        x = args[0] if args else next(iter(kwargs.values()), None)
        target = self.nccl if self.nccl is not None and backend.is_cupy(x) else self.mpi
        return getattr(target, verb)

    def __getattr__(self, verb):
        if verb.startswith("__") or verb in ("nccl", "mpi"):
            raise AttributeError(verb)
        if verb in _ROUTED:
            if not hasattr(self.mpi, verb) and not hasattr(self.nccl, verb):
                raise AttributeError(verb)

            def call(*args, **kwargs):
                return self._route(verb, args, kwargs)(*args, **kwargs)

            call.__name__ = verb
            return call
        return getattr(self.mpi, verb)           # barrier, topology, abort, ... : the MPI side

    def split(self, color, key=None, name=None):
        if self.nccl is None:
            sub = self.mpi.split(color, key, name=name)
            return None if sub is None else DeviceComm(None, sub)
        sub = self.nccl.split(color, key, name=name)
        return None if sub is None else DeviceComm(sub)

    def __repr__(self):
        return f"DeviceComm({self.name!r}, rank={self.rank}, size={self.size}, nccl={self.nccl is not None})"
