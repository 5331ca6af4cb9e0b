"""The Communicator interface every backend implements, and the checks they share.

Shapes: collectives split and concatenate along axis 0. ``reduce_scatter(x)`` with x
(N, ...) gives rank r rows [E[r], E[r+1]) of the reduction, E = nearly equal blocks of N
(the first N % size ranks get one more row); ``allgather(x)`` with x (m, ...) on every
rank gives (size*m, ...); ``alltoall(x)`` with x (size*m, ...) sends rows [i*m, (i+1)*m)
to rank i; ``alltoallv(x, send_counts)`` sends send_counts[i] rows to rank i.
"""
from __future__ import annotations

import math

import numpy as np

from .. import backend
from .algorithms.p2p import bounds
from .dtypes import check_dtype, check_op


class Communicator:
    """One interface over MPI, NCCL and the size-1 communicator (see docs/comm.md)."""

    rank: int = 0
    size: int = 1
    name: str = "comm"
    timeout: float = math.inf

    # --- collectives: defined by each backend --------------------------------------
    def allreduce(self, x, op="sum", algo="auto", out=None, inplace=True, reproducible=False):
        raise NotImplementedError

    def reduce_scatter(self, x, op="sum", algo="auto", out=None, reproducible=False):
        raise NotImplementedError

    def _reproducible(self, verb, x, op, out, inplace=False):
        """allreduce / reduce_scatter with ``reproducible=True``: the sum of the ranks' float32 or
        float64 operands through exact integer bins (comm/exact.py), so its bits depend only on the
        operands, never on the algorithm, the number of ranks or their order. Two integer
        collectives (the bins' tops, then the bins: 3 int64 per float32 element, 4 per float64)."""
        from .exact import ExactSum

        if op != "sum":
            raise ValueError(f"reproducible=True sums (op='sum'); op={op!r} is exact already in any order"
                             if op in ("max", "min") else f"reproducible=True takes op='sum', not {op!r}")
        xp = backend.xp_of(x)
        host = x if xp is np else backend.to_numpy(x)
        acc = ExactSum(host.shape, host.dtype).add(host)
        if verb == "allreduce":
            got = xp.asarray(acc.allreduce(self).value())
            if out is None and not inplace:
                return got
            dst = x if out is None else out
        else:
            got = xp.asarray(acc.reduce_scatter(self).value())
            if out is None:
                return got
            dst = out
        if dst.shape != got.shape:
            raise ValueError(f"{verb} out has shape {dst.shape}, expected {got.shape}")
        dst[...] = got
        return dst

    def allgather(self, x, algo="auto", out=None):
        raise NotImplementedError

    def broadcast(self, x, root=0, algo="auto"):
        raise NotImplementedError

    def alltoall(self, x, out=None, algo="auto"):
        raise NotImplementedError

    def alltoallv(self, x, send_counts, recv_counts=None, out=None):
        raise NotImplementedError

    def barrier(self):
        raise NotImplementedError

    def split(self, color, key=None, name=None):
        raise NotImplementedError

    # --- nonblocking collectives: Request.wait() gives what the blocking verb returns ----------
    # Backends with a real nonblocking path (MPIComm, NCCLComm) override these; the defaults
    # run the blocking verb and hand back a completed request (right for size-1 communicators).
    def iallreduce(self, x, op="sum", algo="auto", out=None, inplace=True):
        return _done(self.allreduce(x, op, algo, out, inplace))

    def ireduce_scatter(self, x, op="sum", algo="auto", out=None):
        return _done(self.reduce_scatter(x, op, algo, out))

    def iallgather(self, x, out=None, algo="auto"):
        return _done(self.allgather(x, algo, out))

    def ibroadcast(self, x, root=0, algo="auto"):
        return _done(self.broadcast(x, root, algo))

    def ialltoall(self, x, out=None, algo="auto"):
        return _done(self.alltoall(x, out, algo))

    def ialltoallv(self, x, send_counts, recv_counts=None, out=None):
        return _done(self.alltoallv(x, send_counts, recv_counts, out))

    def ibarrier(self):
        return _done(self.barrier())

    # --- point to point -------------------------------------------------------------
    def isend(self, x, dest, tag=0):
        raise NotImplementedError

    def irecv(self, buf, source, tag=0):
        raise NotImplementedError

    def send(self, x, dest, tag=0):
        self.isend(x, dest, tag).wait()

    def recv(self, buf, source, tag=0):
        return self.irecv(buf, source, tag).wait()

    def sendrecv(self, x, dest, buf, source, sendtag=0, recvtag=None):
        """Send x to dest while receiving into buf from source; returns buf."""
        return self.isendrecv(x, dest, buf, source, sendtag, recvtag).wait()

    def isendrecv(self, x, dest, buf, source, sendtag=0, recvtag=None):
        """Start a sendrecv; the request's wait() returns buf."""
        r = self.irecv(buf, source, sendtag if recvtag is None else recvtag)
        s = self.isend(x, dest, sendtag)
        return _SendRecv(s, r)

    def __repr__(self):
        return f"{type(self).__name__}(name={self.name!r}, rank={self.rank}, size={self.size})"


def _done(result):
    from .progress import DoneRequest

    return DoneRequest(result)


class _SendRecv:
    """The send and the receive of a sendrecv as one request; wait() returns the buffer."""

    def __init__(self, send, recv):
        self.send, self.recv = send, recv

    def test(self) -> bool:
        return bool(self.send.test()) & bool(self.recv.test())

    def wait(self):
        self.send.wait()
        return self.recv.wait()


# --- argument checks shared by the backends ------------------------------------------
def contiguous(a, what="operand"):
    if not (a.flags.c_contiguous):
        raise ValueError(f"{what} must be C-contiguous (got strides {a.strides}); pass xp.ascontiguousarray(x)")
    check_dtype(a.dtype)
    return a


def flat(a):
    return a.reshape(-1)


def row_bounds(x, size):
    """Element offsets of each rank's block when x (N, ...) is split along axis 0."""
    rows = x.shape[0] if x.ndim else 1
    per_row = int(np.prod(x.shape[1:])) if x.ndim > 1 else 1
    return [b * per_row for b in bounds(rows, size)], bounds(rows, size)


def check_out(out, shape, dtype, what):
    if out is None:
        return None
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise ValueError(f"{what}: out has shape {tuple(out.shape)} dtype {out.dtype}, expected shape {tuple(shape)} dtype {dtype}")
    return contiguous(out, f"{what} out")


def new_like(x, shape):
    return backend.xp_of(x).empty(shape, dtype=x.dtype)


__all__ = ["Communicator", "check_op", "contiguous", "flat", "row_bounds", "check_out", "new_like"]
