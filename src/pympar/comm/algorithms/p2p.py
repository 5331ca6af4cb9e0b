"""The context an algorithm runs in: its communicator, deadline, reduction and block layout."""
from __future__ import annotations

from ... import backend, kernels
from ..dtypes import raw_bytes


def bounds(count: int, parts: int):
    """Offsets of ``parts`` nearly equal blocks of ``count`` (the first count % parts get one more).

    bounds(10, 3) -> [0, 4, 7, 10]
    """
    q, r = divmod(count, parts)
    out = [0]
    for i in range(parts):
        out.append(out[-1] + q + (1 if i < r else 0))
    return out


class Ctx:
    """An algorithm's view of one call: p2p on ``comm`` (mpi4py), waits through ``waiter``."""

    def __init__(self, comm, waiter, op: str = "sum", sync=None, tag=0, rank=None, size=None):
        self.comm, self.waiter, self.op, self.tag = comm, waiter, op, tag
        self.rank = comm.Get_rank() if rank is None else rank
        self.size = comm.Get_size() if size is None else size
        self._sync = sync  # device-stream synchronisation before MPI reads device memory

    # tag None: the call's own tag (0 for blocking calls; nonblocking ones in flight together
    # each get their own, so their messages cannot match each other's receives)
    def isend(self, a, dest, tag=None):
        if self._sync is not None:
            self._sync()
        return self.comm.Isend(raw_bytes(a), dest, self.tag if tag is None else tag)

    def irecv(self, a, source, tag=None):
        return self.comm.Irecv(raw_bytes(a), source, self.tag if tag is None else tag)

    def send(self, a, dest, tag=None):
        self.waiter.wait1(self.isend(a, dest, tag), dest)

    def recv(self, a, source, tag=None):
        self.waiter.wait1(self.irecv(a, source, tag), source)

    def sendrecv(self, sbuf, dest, rbuf, source, tag=None):
        reqs = [self.irecv(rbuf, source, tag), self.isend(sbuf, dest, tag)]
        self.waiter.wait(reqs, [source, dest])

    def reduce(self, dst, src):
        kernels.reduce_inplace(dst, src, self.op)

    def empty(self, n, like):
        return backend.xp_of(like).empty(n, dtype=like.dtype)


def power_of_two_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)

