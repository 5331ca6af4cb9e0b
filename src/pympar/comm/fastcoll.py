"""A planned collective's per-call path in C (csrc/fastcoll.cpp).

MPIComm keeps a plan per call key (plans.py); a plan that runs the MPI library's own call --
blocking ("blocking") or nonblocking and polled ("mpi") -- of allreduce, broadcast, allgather
or alltoall also gets a C form here. The C form checks the operands against the plan, counts
the call, stores it on the arrival board, arms the deadline guard (blocking) and calls the
library's function straight, with the GIL released: the steps of MPIComm._planned without the
interpreter, and without mpi4py's per-call argument handling.

The library's functions are found in the MPI library this process loaded (the one mpi4py
uses, read from /proc/self/maps), their handles from mpi4py. Where that cannot be done --
no native module, no /proc, more than one MPI library loaded, a symbol missing -- every
call takes the Python path, which gives the same results (tests/mpi/mpi_comm_fastpath.py).
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

from .dtypes import mpi_op, mpi_type
from .lazympi import MPI
from . import progress, watchdog

try:
    from .._C import fastcoll_make, fastcoll_run as run
except ImportError:     # no native module: the Python path only
    fastcoll_make = None

    def run(plan, x, out, op, algo, inplace):
        return None

VERBS = {"allreduce": 0, "broadcast": 1, "allgather": 2, "alltoall": 3}
_NAMES = {"allreduce": "Allreduce", "broadcast": "Bcast", "allgather": "Allgather", "alltoall": "Alltoall"}
_lib = None


def _loaded_mpi():
    """Path of the MPI library loaded in this process (libmpi.so*), or None (none, or several)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/libmpi" in line}
    except OSError:
        return None
    paths = {p for p in paths if os.path.basename(p).startswith("libmpi.so")}
    return paths.pop() if len(paths) == 1 else None


def library():
    """{name: address} of the library's functions, with "hbytes" (the size of a handle) and
    "in_place" (MPI_IN_PLACE); {} where the C path cannot be used (see the module docstring)."""
    global _lib
    if _lib is None:
        _lib = {}
        path = _loaded_mpi() if fastcoll_make is not None else None
        if path is not None:
            try:
                lib = ctypes.CDLL(path, mode=os.RTLD_NOW | getattr(os, "RTLD_NOLOAD", 0))
                names = [f"MPI_{n}" for n in _NAMES.values()] + [f"MPI_I{n.lower()}" for n in _NAMES.values()]
                names.append("MPI_Test")
                _lib = {n: ctypes.cast(lib[n], ctypes.c_void_p).value for n in names}
                _lib["hbytes"] = MPI._sizeof(MPI.Comm)
                _lib["in_place"] = int(MPI.IN_PLACE)
            except (OSError, AttributeError, TypeError, ValueError):   # a symbol missing, ...
                _lib = {}
    return _lib


def _handle(obj) -> int:
    """An MPI object's handle as a signed 64-bit integer (mpi4py gives it unsigned)."""
    h = MPI._handleof(obj)
    return h - (1 << 64) if h >= 1 << 63 else h


def yield_seconds(comm) -> float:
    """How long a planned nonblocking call of ``comm`` tests between yields in C before it hands
    its request to the Python Waiter: the pace's yield phase, within the communicator's timeout
    (the Waiter's deadline counts it: MPIComm._c_finish)."""
    return min(progress.YIELD_SECONDS, comm.timeout)


def make(comm, plan, x, key):
    """The C form of plan (made for x under key), or None where the C path does not apply:
    another algorithm, avg (its division runs after the call), a 2-byte float reduction (its
    user-defined op), a count past the library's int, a non-native byte order."""
    verb, algo = plan.verb, plan.algo
    if (verb not in VERBS or algo not in ("blocking", "mpi") or plan.avg or not x.dtype.isnative
            or (verb == "allreduce" and x.dtype.itemsize == 2)):
        return None
    lib = library()
    if not lib:
        return None
    count = x.size // comm.size if verb == "alltoall" else x.size
    if count > 2**31 - 1 or (verb == "alltoall" and x.size % comm.size):
        return None
    name = _NAMES[verb]
    fn = lib[f"MPI_{name}" if algo == "blocking" else f"MPI_I{name.lower()}"]
    op = _handle(mpi_op(plan.op, x.dtype)) if verb == "allreduce" else 0
    try:
        return fastcoll_make(VERBS[verb], algo == "blocking", lib["hbytes"], fn, lib["MPI_Test"],
                             _handle(comm._coll), _handle(mpi_type(x.dtype)), op,
                             plan.root, lib["in_place"], np.dtype(x.dtype.type), tuple(x.shape), tuple(plan.out_shape), count,
                             key[3], key[4], comm._count, comm._board.slots, plan.code, watchdog.SLOT,
                             comm._token, progress.PACE, bool(comm._abort_token), yield_seconds(comm))
    except (TypeError, ValueError):
        return None
