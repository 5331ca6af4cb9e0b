"""pympar.comm: one Communicator interface over MPI (mpi4py), NCCL and a single process.

    from pympar import comm
    c = comm.world()                      # or comm.MPIComm(my_mpi4py_comm)
    c.allreduce(grad, op="avg")           # in place; algo="auto" | ring | shm | ...

See docs/comm.md for the verbs, the algorithms and the benchmark.
"""
from .base import Communicator
from .errors import CommTimeoutError
from .progress import Request
from .selfcomm import SelfComm
from .staging import HostStaging


def __getattr__(name):  # mpi4py (and MPI_Init) only when an MPI communicator is asked for
    if name == "ALGOS":
        from .verbs import ALGOS

        return ALGOS
    if name in ("MPIComm", "world"):
        from . import mpi

        return getattr(mpi, name)
    if name == "NCCLComm":
        from .nccl import NCCLComm

        return NCCLComm
    raise AttributeError(f"module 'pympar.comm' has no attribute {name!r}")


def world():
    from .mpi import world as _world

    return _world()


__all__ = ["Communicator", "CommTimeoutError", "Request", "SelfComm", "HostStaging", "MPIComm", "NCCLComm", "world"]
