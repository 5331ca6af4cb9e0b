"""Per-call plans: what a repeated blocking collective needs, decided on its first call.

MPIComm's general path of allreduce, reduce_scatter, allgather, broadcast and alltoall
checks the operands, picks the algorithm and builds a :class:`Plan`; for a NumPy operand
outside debug mode it keeps that plan under the call's key

    (verb, dtype, shape, op | root | None, algo as the caller wrote it)

A later call with the same key skips the checks and decisions (MPIComm._planned): its
operand is C-contiguous NumPy, its dtype and algorithm were accepted when the plan was
made, and the plan knows the output's shape, the MPI datatype and op, and how to start
the library's nonblocking collective. Both paths run the collective through the same
plan (MPIComm._run), so they cannot drift apart.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .dtypes import mpi_op, mpi_type
from .watchdog import op_code

MAX_PLANS = 4096          # per communicator; past it new keys run the general path only
_U16 = np.dtype(np.uint16)


class Plan:
    """One collective's decisions for one key (see the module docstring).

    algo: the algorithm that runs ("mpi": the library's own); out_shape: the result's shape;
    in_place: the verb can write into its operand (allreduce, broadcast); E: element bounds
    of the ranks' blocks (reduce_scatter); own: MPIComm's runner of pympar's algorithms for
    this verb, called as own(comm, waiter, plan, x, dst).
    """

    __slots__ = ("verb", "code", "algo", "op", "root", "mtype", "mop", "raw16", "avg",
                 "out_shape", "in_place", "E", "counts", "start", "own")

    def __init__(self, verb, algo, dtype, out_shape, own, op=None, root=0, E=None):
        self.verb, self.code, self.algo, self.own = verb, op_code(verb), algo, own
        self.op, self.root, self.avg = op, root, op == "avg"
        self.mtype = mpi_type(dtype)
        self.mop = mpi_op(op, dtype) if op is not None else None
        self.raw16 = dtype.itemsize == 2   # float16/bfloat16 travel as raw 2-byte words
        self.out_shape, self.in_place = tuple(out_shape), verb in ("allreduce", "broadcast")
        self.E = E
        self.counts = [E[i + 1] - E[i] for i in range(len(E) - 1)] if E is not None else None
        self.start = _STARTS[verb]

    def start_library(self, coll, x, dst):
        """Start the library's nonblocking collective of x into dst on ``coll``; the MPI request."""
        t = self.mtype
        if dst is x:
            return self.start(self, coll, [x.view(_U16) if self.raw16 else x, t], None)
        if self.raw16:   # memoryview refuses bfloat16: the same bytes as uint16
            x, dst = x.view(_U16), dst.view(_U16)
        return self.start(self, coll, [x, t], [dst, t])


# the library's collectives: s = [send buffer, type]; d = [receive buffer, type], None in place.
# Receive specs carry no count: mpi4py divides the buffer by the size for allgather/alltoall.
def _start_allreduce(p, coll, s, d):
    return coll.Iallreduce(MPI.IN_PLACE, s, p.mop) if d is None else coll.Iallreduce(s, d, p.mop)


def _start_reduce_scatter(p, coll, s, d):
    return coll.Ireduce_scatter(s, d, p.counts, p.mop)


def _start_allgather(p, coll, s, d):
    return coll.Iallgather(s, d)


def _start_broadcast(p, coll, s, d):
    return coll.Ibcast(s, p.root)


def _start_alltoall(p, coll, s, d):
    return coll.Ialltoall(s, d)


_STARTS = {"allreduce": _start_allreduce, "reduce_scatter": _start_reduce_scatter,
           "allgather": _start_allgather, "broadcast": _start_broadcast, "alltoall": _start_alltoall}
