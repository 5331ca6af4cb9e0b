"""Per-call plans: what a repeated blocking collective needs, decided on its first call.

MPIComm's general path of allreduce, reduce_scatter, allgather, broadcast and alltoall
checks the operands, picks the algorithm and builds a :class:`Plan`; for a NumPy operand
outside debug mode it keeps that plan under the call's key

    (verb, dtype, shape, op | root | None, algo as the caller wrote it)

A later call with the same key skips the checks and decisions (MPIComm._planned): its
operand is C-contiguous NumPy, its dtype and algorithm were accepted when the plan was
made, and the plan knows the output's shape, the MPI datatype and op, and how to start
the library's nonblocking collective (bound to the communicator once, library_start).
Both paths run the collective by the same plan -- its library start or the verb's runner
of pympar's algorithms (MPIComm._run) -- so they cannot drift apart.
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
    this verb, called as own(comm, waiter, plan, x, dst); start(x, dst): the library's
    nonblocking collective on ``coll`` started, its MPI request (dst is x: in place).
    """

    __slots__ = ("verb", "code", "algo", "op", "root", "avg", "out_shape", "in_place", "E",
                 "start", "call", "own", "native")

    def __init__(self, verb, algo, dtype, out_shape, own, coll, op=None, root=0, E=None):
        self.verb, self.code, self.algo, self.own = verb, op_code(verb), algo, own
        self.op, self.root, self.avg = op, root, op == "avg"
        self.out_shape, self.in_place = tuple(out_shape), verb in ("allreduce", "broadcast")
        self.E = E
        self.native = None    # the C form of the library's call (fastcoll.make), set by MPIComm._plan
        counts = [E[i + 1] - E[i] for i in range(len(E) - 1)] if E is not None else None
        mop = mpi_op(op, dtype) if op is not None else None
        self.start = library_start(verb, coll, mpi_type(dtype), mop, counts, root, dtype.itemsize == 2)
        # algo "blocking": the library's blocking collective (MPIComm runs it under the deadline guard)
        self.call = (library_call(verb, coll, mpi_type(dtype), mop, counts, root, dtype.itemsize == 2)
                     if algo == "blocking" else None)


def library_start(verb, coll, t, mop=None, counts=None, root=0, raw16=False):
    """start(x, dst) -> the MPI request of the library's nonblocking ``verb`` of x into dst.

    Bound once per plan (the per-call work is building two buffer specs). t: the MPI type of
    an element; mop: the MPI op (reductions); counts: the ranks' block sizes (reduce_scatter);
    raw16: float16/bfloat16, which travel as raw 2-byte words (memoryview refuses bfloat16).
    Receive specs carry no count: mpi4py divides the buffer by the size for allgather/alltoall.
    """
    if verb == "allreduce":
        call, in_place = coll.Iallreduce, MPI.IN_PLACE

        def start(x, d):
            return call(in_place, [x, t], mop) if d is x else call([x, t], [d, t], mop)
    elif verb == "reduce_scatter":
        call = coll.Ireduce_scatter

        def start(x, d):
            return call([x, t], [d, t], counts, mop)
    elif verb == "broadcast":
        call = coll.Ibcast

        def start(x, d):
            return call([x, t], root)
    else:   # allgather, alltoall
        call = {"allgather": coll.Iallgather, "alltoall": coll.Ialltoall}[verb]

        def start(x, d):
            return call([x, t], [d, t])
    if not raw16:
        return start
    words = start

    def start16(x, d):
        xw = x.view(_U16)
        return words(xw, xw if d is x else d.view(_U16))
    return start16


def library_call(verb, coll, t, mop=None, counts=None, root=0, raw16=False):
    """call(x, dst): the library's *blocking* ``verb`` of x into dst (the same operands as
    library_start). It cannot be polled against a deadline: MPIComm arms the process's
    DeadlineGuard around it (watchdog.py), which ends the job when the deadline passes."""
    if verb == "allreduce":
        f = coll.Allreduce

        def call(x, d):
            f(MPI.IN_PLACE, [x, t], mop) if d is x else f([x, t], [d, t], mop)
    elif verb == "reduce_scatter":
        f = coll.Reduce_scatter

        def call(x, d):
            f([x, t], [d, t], counts, mop)
    elif verb == "broadcast":
        f = coll.Bcast

        def call(x, d):
            f([x, t], root)
    else:
        f = {"allgather": coll.Allgather, "alltoall": coll.Alltoall}[verb]

        def call(x, d):
            f([x, t], [d, t])
    if not raw16:
        return call
    words = call

    def call16(x, d):
        xw = x.view(_U16)
        words(xw, xw if d is x else d.view(_U16))
    return call16
