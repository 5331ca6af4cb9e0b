"""Collectives through an MPI-3 shared-memory window on a node communicator.

Each rank owns a segment of the window: a 64-byte header (its barrier counter, alone on
its cache line) and two data regions used alternately by successive calls, so one call's
readers never race the next call's writers. Allreduce runs chunk by chunk through two slots
of its region with per-rank progress counters (see the note above shm_allreduce); the other
verbs copy in, meet at a barrier and read. The barrier is a counter per rank in shared
memory, so a stalled barrier or counter wait can name the ranks that did not arrive.
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
from ..settings import SETTINGS
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
        self.chunks = 0   # allreduce chunks done on this window (the counters' numbering)
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
            self.cap, self.epoch, self.chunks = cap, 0, 0
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
                waiter.fail(CommTimeoutError(waiter.op, waiter.comm_name, waiter.seq, missing, waiter.timeout,
                                             "shared-memory barrier"))
        self.win.Sync()          # and we see everyone's writes

    def free(self):
        if self.win is not None:
            self.win.Unlock_all()
            self.win.Free()
            self.win = None


# --- allreduce: cache-blocked and pipelined --------------------------------------------------
# The vector goes through in chunks of about settings.shm_chunk bytes (512 KiB unless configured;
# PYMPAR_SHM_CHUNK at the edge), each rank's region holding SLOTS chunk slots
# used in turn. For chunk j every rank (1) copies its input chunk, all but its own slice, into a
# slot and raises its IN counter; (2) once every IN counter has the chunk, reduces its slice of
# the chunk from its own input and the others' slots, writes it to dst and into its slot, and
# raises RED; (3) once every RED counter has the chunk, copies the others' reduced slices out of
# their slots and raises OUT, which frees the slot for chunk j+SLOTS. The copy-in of chunk j+1
# sits between (2) and (3), so waiting for the slowest reducer overlaps with useful work; the
# slots stay in the last-level cache between the copy-in, the reduction and the copy-out, and
# only src and dst stream through memory. Counters are per rank in the header (only the owner
# writes), numbered across calls (ShmArena.chunks), so a stalled wait names the ranks behind.
SLOTS = 2
_IN, _RED, _OUT = 1, 2, 3          # header words (int64) of the per-rank counters; 0 is the barrier
# dtypes whose first reduction step runs as one three-operand NumPy ufunc pass (acc = a op b)
# instead of a copy and an in-place reduction; 2-byte floats go through the kernels
_UFUNCS = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}
_UFUNC_DTYPES = tuple(np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64))


def chunk_elements(itemsize, n, chunk_bytes=None):
    """Elements per chunk: about chunk_bytes, a multiple of 32*n so every slice is 64-byte aligned."""
    unit = 32 * n
    return max(unit, (chunk_bytes or SETTINGS.shm_chunk) // itemsize // unit * unit)


def _wait_counters(arena, word, value, waiter, what):
    """Until every node rank's counter ``word`` reaches ``value``; names the ranks behind on timeout."""
    flags = arena.flags
    for f in flags:
        if f[word] < value:
            pace = Backoff()
            while f[word] < value:
                now = pace.pause()
                if now is not None and now > waiter.deadline:
                    missing = [arena.parent_ranks[k] for k, g in enumerate(flags) if g[word] < value]
                    waiter.fail(CommTimeoutError(waiter.op, waiter.comm_name, waiter.seq, missing, waiter.timeout,
                                                 f"shared-memory allreduce, {what} of chunk {value}"))
    arena.win.Sync()              # and we see what they wrote before raising it


def shm_allreduce(arena, waiter, src, dst, op, chunk_bytes=None):
    """dst (count,) = op over node ranks of src (count,); src may be dst. See the note above."""
    n, r, count = arena.size, arena.rank, src.size
    if count == 0:
        return
    C = chunk_elements(src.itemsize, n, chunk_bytes)
    K = -(-count // C)                                   # chunks
    ns = min(SLOTS, K)
    par = arena.ensure(ns * C * src.itemsize, waiter)
    dt = src.dtype
    slots = [arena.region(k, par, dt, ns * C) for k in range(n)]   # (ns*C,) per node rank
    me, mine, red = arena.flags[r], slots[r], reduce_op(op)
    first = _UFUNCS[red] if dt in _UFUNC_DTYPES else None
    base = arena.chunks
    arena.chunks += K
    sync = arena.win.Sync

    def layout(j):
        a = j * C
        m = min(C, count - a)
        return a, m, bounds(m, n), (j % ns) * C

    def copy_in(j):
        a, m, E, o = layout(j)
        lo, hi = E[r], E[r + 1]
        if j >= ns:                                      # slot free: chunk j-ns copied out everywhere
            _wait_counters(arena, _OUT, base + j - ns + 1, waiter, "copy-out")
        np.copyto(mine[o:o + lo], src[a:a + lo])
        np.copyto(mine[o + hi:o + m], src[a + hi:a + m])
        sync()
        me[_IN] = base + j + 1

    copy_in(0)
    for j in range(K):
        a, m, E, o = layout(j)
        lo, hi = E[r], E[r + 1]
        _wait_counters(arena, _IN, base + j + 1, waiter, "copy-in")
        acc = mine[o + lo:o + hi]
        if first is not None:
            first(src[a + lo:a + hi], slots[(r + 1) % n][o + lo:o + hi], out=acc)
        else:
            np.copyto(acc, src[a + lo:a + hi])
            kernels.reduce_inplace(acc, slots[(r + 1) % n][o + lo:o + hi], red)
        for i in range(2, n):
            kernels.reduce_inplace(acc, slots[(r + i) % n][o + lo:o + hi], red)
        if op == "avg":
            finish_avg(acc, n)
        np.copyto(dst[a + lo:a + hi], acc)
        sync()
        me[_RED] = base + j + 1
        if j + 1 < K:
            copy_in(j + 1)                               # overlaps the slowest rank's reduction
        _wait_counters(arena, _RED, base + j + 1, waiter, "reduction")
        for i in range(1, n):
            k = (r + i) % n
            np.copyto(dst[a + E[k]:a + E[k + 1]], slots[k][o + E[k]:o + E[k + 1]])
        me[_OUT] = base + j + 1


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
