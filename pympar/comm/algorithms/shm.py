"""Collectives through an MPI-3 shared-memory window on a node communicator.

Each rank owns a segment of the window: a 64-byte header (its barrier counter, alone on
its cache line) and two data regions used alternately by successive calls, so one call's
readers never race the next call's writers. Allreduce: every rank copies its input into
its region, then reduces its slice straight out of all the others' regions into its own,
then gathers every rank's reduced slice. The barrier is a counter per rank in shared
memory, so a stalled barrier can name the ranks that did not arrive.
"""
from __future__ import annotations

import atexit
import weakref

import numpy as np
from mpi4py import MPI

from ... import kernels
from ..dtypes import finish_avg, reduce_op
from ..errors import CommTimeoutError
from ..progress import Backoff
from .p2p import bounds

HEADER = 64
_LIVE = weakref.WeakSet()


@atexit.register
def _close_epochs():
    """Close the passive epochs before mpi4py's MPI_Finalize (local; finalize frees windows)."""
    for arena in list(_LIVE):
        if arena.win is not None:
            try:
                arena.win.Unlock_all()
            except Exception:
                pass
            arena.win = None


class ShmArena:
    """The shared window of one node communicator (mpi4py), grown on demand (collectively)."""

    def __init__(self, node_comm, parent_ranks):
        self.comm = node_comm
        self.rank, self.size = node_comm.Get_rank(), node_comm.Get_size()
        self.parent_ranks = parent_ranks  # node rank -> rank in the owning communicator
        self.win, self.cap, self.epoch, self.parity = None, 0, 0, 0
        self.data, self.flags = [], []
        _LIVE.add(self)

    def ensure(self, nbytes, waiter):
        """Make each region hold nbytes; returns the parity this call should use."""
        if self.win is None or nbytes > self.cap:
            if self.win is not None:
                self.barrier(waiter)  # nobody still reads the old window
                self.win.Unlock_all()
                self.win.Free()
            cap = max(nbytes, 2 * self.cap, 1 << 16)
            cap = (cap + 63) // 64 * 64
            self.win = MPI.Win.Allocate_shared(HEADER + 2 * cap, 1, comm=self.comm)
            self.win.Lock_all(MPI.MODE_NOCHECK)  # one passive epoch: Win.Sync is then a memory fence
            self.cap, self.epoch = cap, 0
            segs = [np.frombuffer(self.win.Shared_query(k)[0], dtype=np.uint8) for k in range(self.size)]
            self.flags = [s[:HEADER].view(np.int64) for s in segs]
            self.data = [s[HEADER:] for s in segs]
            self.flags[self.rank][:] = 0
            self.win.Sync()
            self.comm.Barrier()
        self.parity ^= 1
        return self.parity

    def region(self, k, parity, dtype, count):
        off = parity * self.cap
        return self.data[k][off:off + count * np.dtype(dtype).itemsize].view(dtype)

    def barrier(self, waiter):
        """All node ranks arrive; raises CommTimeoutError naming the missing ranks."""
        self.epoch += 1
        e = self.epoch
        self.win.Sync()          # our writes are visible before the counter moves
        self.flags[self.rank][0] = e
        flags = self.flags
        pace = Backoff()
        while not all(f[0] >= e for f in flags):
            now = pace.pause()
            if now is not None and now > waiter.deadline:
                missing = [self.parent_ranks[k] for k, f in enumerate(flags) if f[0] < e]
                raise CommTimeoutError(waiter.op, waiter.comm_name, waiter.seq, missing, waiter.timeout,
                                       "shared-memory barrier")
        self.win.Sync()          # and we see everyone's writes

    def free(self):
        if self.win is not None:
            self.win.Unlock_all()
            self.win.Free()
            self.win = None


def shm_allreduce(arena, waiter, src, dst, op):
    """dst (count,) = op over ranks of src (count,); src may be dst.

    Rank r publishes every slice but its own (nobody else reads slice r of rank r), reduces
    slice r from its own src and the others' regions into its region, then gathers.
    """
    n, r, count = arena.size, arena.rank, src.size
    par = arena.ensure(src.nbytes, waiter)
    E = bounds(count, n)
    lo, hi = E[r], E[r + 1]
    mine = arena.region(r, par, src.dtype, count)
    np.copyto(mine[:lo], src[:lo])
    np.copyto(mine[hi:], src[hi:])
    arena.barrier(waiter)
    acc, red = mine[lo:hi], reduce_op(op)
    np.copyto(acc, src[lo:hi])
    for j in range(1, n):
        kernels.reduce_inplace(acc, arena.region((r + j) % n, par, src.dtype, count)[lo:hi], red)
    if op == "avg":
        finish_avg(acc, n)
    np.copyto(dst[lo:hi], acc)
    arena.barrier(waiter)
    for k in range(n):
        if k != r:
            np.copyto(dst[E[k]:E[k + 1]], arena.region(k, par, src.dtype, count)[E[k]:E[k + 1]])


def shm_reduce_scatter(arena, waiter, src, out, E, op):
    """out (E[r+1]-E[r],) = op over ranks of src[E[r]:E[r+1]]."""
    n, r, count = arena.size, arena.rank, src.size
    par = arena.ensure(src.nbytes, waiter)
    np.copyto(arena.region(r, par, src.dtype, count), src)
    arena.barrier(waiter)
    lo, hi = E[r], E[r + 1]
    np.copyto(out, arena.region(r, par, src.dtype, count)[lo:hi])
    red = reduce_op(op)
    for j in range(1, n):
        kernels.reduce_inplace(out, arena.region((r + j) % n, par, src.dtype, count)[lo:hi], red)
    if op == "avg":
        finish_avg(out, n)


def shm_allgather(arena, waiter, src, out):
    """out (n*m,) = concatenation over node ranks of src (m,)."""
    n, r, m = arena.size, arena.rank, src.size
    par = arena.ensure(src.nbytes, waiter)
    np.copyto(arena.region(r, par, src.dtype, m), src)
    arena.barrier(waiter)
    for k in range(n):
        np.copyto(out[k * m:(k + 1) * m], arena.region(k, par, src.dtype, m))


def shm_broadcast(arena, waiter, buf, root):
    """buf (count,) of node rank root copied to every node rank."""
    par = arena.ensure(buf.nbytes, waiter)
    if arena.rank == root:
        np.copyto(arena.region(root, par, buf.dtype, buf.size), buf)
    arena.barrier(waiter)
    if arena.rank != root:
        np.copyto(buf, arena.region(root, par, buf.dtype, buf.size))
