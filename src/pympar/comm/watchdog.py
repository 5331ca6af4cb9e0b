"""Collective watchdog: who did not arrive, and ending the whole job when a wait expires.

Every MPIComm keeps an :class:`ArrivalBoard`: a tiny RMA window on a shadow communicator
(a ``Dup``) holding this rank's last collective entered, ``(seq, op code)``. Entering a
collective is one local store into that memory (no message, no MPI call), so the board
costs nothing while things go well. Only when a wait passes its deadline does the waiting
rank read every peer's slot (passive-target ``Rget``, itself bounded in time) and list the
ranks that never entered the stalled call: the ones a point-to-point algorithm cannot name
(a ring waits on its neighbour, not on the rank that skipped) and the ones a library
collective cannot name at all.

``abort_job(err)`` prints the report on this rank's stderr and calls ``MPI_Abort`` on
COMM_WORLD, so a stalled or dead rank ends every rank of the job with a non-zero status.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref
import zlib

import numpy as np

from .errors import CommTimeoutError
from .progress import SLOT, Backoff, Waiter, default_timeout

ABORT_STATUS = 3          # exit status of a job ended by the watchdog (2 = bad configuration)
READ_SECONDS = 2.0        # how long a timed-out rank waits for the peers' slots
# names of the operations MPIComm issues, so a report can name a call this rank never made
KNOWN_OPS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "alltoall", "alltoallv",
             "alltoallv.counts", "barrier", "iallreduce", "iallgather", "ibroadcast",
             "ireduce_scatter", "ialltoall", "ialltoallv", "ibarrier")


_LIVE = []                # boards not yet freed, in creation order (the same on every rank)
_TAINTED = False          # a wait expired here: the peers may be gone, freeing could block


@atexit.register
def _free_live_boards():
    """Free the windows before mpi4py's MPI_Finalize (left allocated, UCX warns per window).

    Win_free is collective and waits without a deadline, so a rank that reaches it while a peer
    still runs a collective this rank will never call would block for good. Each board therefore
    first meets its peers in a nonblocking barrier on its own shadow communicator (every rank
    frees the same boards in the same order, creation order); see ArrivalBoard.meet_at_exit.
    After a timeout on this rank the peers may be gone, so nothing is freed then (MPI_Finalize
    cleans up)."""
    if _TAINTED:
        return
    for board in list(_LIVE):
        board.meet_at_exit()
        board.free()


class ExitMismatchError(RuntimeError):
    """A rank is exiting while a peer waits in a collective this rank never entered."""


def op_code(op: str) -> int:
    """A stable integer for an operation name (the same on every rank and run)."""
    return zlib.crc32(op.encode())


class ArrivalBoard:
    """This rank's last collective ``(seq, op code)``, readable by the other ranks on demand.

    Collective to build and to free (over ``mpi_comm``'s ranks); ``enter`` is local.
    """

    def __init__(self, mpi_comm, name: str = "comm", timeout: float | None = None):
        from mpi4py import MPI

        self._MPI = MPI
        self.name = name
        self.timeout = default_timeout() if timeout is None else float(timeout)   # for meet_at_exit
        self._dangling = []   # (request, peer) of reads given up with their epoch still open
        self._readers = {}    # peer -> the thread of the last read of its slot (may outlive read())
        self.comm = mpi_comm.Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.names = {op_code(n): n for n in KNOWN_OPS}     # op code -> name (for reports)
        self._codes = {n: c for c, n in self.names.items()}
        self.win = None
        self.on_free = []     # called when the board's memory goes (holders of its address let go)
        self.abort = False    # a timed-out wait ends the job (MPIComm on_timeout="abort"; Waiter.fail)
        if self.size > 1:   # memory the library allocates (user memory left registered warns at exit)
            self.win = MPI.Win.Allocate(16, 8, comm=self.comm)
            # [seq, op code] as a memoryview: a store costs ~40 ns, a NumPy item store ~100
            self.slots = memoryview(self.win.tomemory()).cast("B").cast("q")
            self.slots[0] = self.slots[1] = 0
        else:
            self.slots = _local_slots()
        _LIVE.append(self)

    def timed_out(self, err: CommTimeoutError):
        """A wait on this communicator passed its deadline: end the job with the report when the
        communicator says so (abort), else return (the caller raises err)."""
        if self.abort:
            abort_job(err)

    def enter(self, seq: int, op: str):
        code = self._codes.get(op)
        if code is None:
            code = self._codes[op] = op_code(op)
            self.names[code] = op
        slots = self.slots
        slots[1] = code
        slots[0] = seq

    def read(self, timeout: float = READ_SECONDS) -> dict:
        """{peer rank: (seq, op code)} of the peers that answered within ``timeout`` seconds.

        One helper thread per peer: an MPI library may block a lock or a get until the target
        enters MPI (or forever when it died), and neither the report nor the reads of the
        other peers may wait for that (the threads' MPI calls also answer the peers' reads)."""
        if self.win is None:
            return {}
        out, deadline = {}, time.monotonic() + timeout
        # a peer whose earlier read is still running or left its epoch open is not read again
        # (a second lock on the same target from this process is erroneous): it did not answer
        busy = {q for _, q in self._dangling} | {q for q, t in self._readers.items() if t.is_alive()}
        threads = []
        for p in range(self.size):
            if p != self.rank and p not in busy:
                t = self._readers[p] = threading.Thread(target=self._read_one, args=(p, out, deadline), daemon=True)
                threads.append(t)
                t.start()
        for t in threads:
            t.join(max(0.0, deadline + 0.2 - time.monotonic()))
        return dict(out)

    def _read_one(self, p, out, deadline):
        MPI = self._MPI
        buf = np.full(2, -1, np.int64)
        try:
            self.win.Lock(p, MPI.LOCK_SHARED)
            req = self.win.Rget(buf, p)
            while not req.Test():
                if time.monotonic() > deadline:
                    self._dangling.append((req, p))   # the epoch stays open (closed in free())
                    return
                time.sleep(1e-4)
            self.win.Unlock(p)
        except MPI.Exception:
            return
        out[p] = (int(buf[0]), int(buf[1]))

    def missing(self, seq: int, op: str, timeout: float = READ_SECONDS):
        """(ranks that did not enter call #seq, one-line details) -- read from the peers."""
        global _TAINTED
        _TAINTED = True
        code = op_code(op)
        got = self.read(timeout)
        missing, notes = [], []
        for p in range(self.size):
            if p == self.rank:
                continue
            if p not in got:
                missing.append(p)
                notes.append(f"rank {p} did not answer (dead, or busy outside MPI)")
                continue
            s, c = got[p]
            name = self.names.get(c, f"op#{c}")
            if s < seq:
                missing.append(p)
                notes.append(f"rank {p} is at #{s} ({name})" if s > 0 else f"rank {p} entered no collective yet")
            elif s == seq and c != code:
                missing.append(p)
                notes.append(f"rank {p} called {name} as #{s}")
        return missing, notes

    def meet_at_exit(self):
        """Block until every rank of this board is tearing it down (then Win_free cannot hang).

        A nonblocking barrier on the board's own communicator, polled. Each time ``timeout``
        passes, this rank reads every board it holds: a peer that already entered a collective
        this (exiting) rank never entered would wait for it forever, so the job is ended with
        a report naming the communicator, the peer and the call (watchdog.abort_job). Peers that
        are only late (rank 0 still sampling text, writing a trace) are waited for."""
        if self.win is None:
            return
        req = self.comm.Ibarrier()
        pace, start = Backoff(), time.monotonic()
        check = start + self.timeout if np.isfinite(self.timeout) else np.inf
        while not req.Test():
            now = pace.pause()
            if now is not None and now > check:
                stuck = _peers_ahead()
                if stuck:
                    abort_job(ExitMismatchError(
                        f"exiting, but after {now - start:.1f}s at teardown peers still wait in collectives "
                        f"this rank never entered: {'; '.join(stuck)} (every rank must run the same "
                        f"collectives, in the same order, on each communicator)"))
                check = now + self.timeout

    def free(self):
        for f in self.on_free:
            f()
        self.on_free = []
        if self in _LIVE:
            _LIVE.remove(self)
        if self.win is not None:
            # a read thread may still be inside its lock or get (a peer that was late to answer):
            # let it finish first, or Win_free would meet an open access epoch. Every peer is in
            # this teardown now (meet_at_exit), so their slots answer.
            for t in self._readers.values():
                t.join()
            self._readers = {}
            for req, p in self._dangling:   # reads given up on: finish them, close their epochs
                req.Wait()
                self.win.Unlock(p)
            self._dangling = []
            self.slots = _local_slots()     # the window's memory goes with it
            self.win.Free()
            self.win = None
        if self.comm is not None:
            self.comm.Free()
            self.comm = None


def _local_slots():
    return memoryview(bytearray(16)).cast("q")


def _peers_ahead() -> list:
    """'comm NAME: rank p waits in #s (op); this rank is at #m' for every live board's peer whose
    last collective is past this rank's (read from the peers, bounded in time)."""
    out = []
    for board in list(_LIVE):
        if board.win is None:
            continue
        mine = int(board.slots[0])
        for p, (s, c) in sorted(board.read().items()):
            if s > mine:
                out.append(f"comm {board.name}: rank {p} waits in #{s} ({board.names.get(c, f'op#{c}')}), "
                           f"this rank's last is #{mine}")
    return out


def report(err: BaseException, rank: int | None = None, what: str = "collective watchdog") -> str:
    """The one-line report of a watchdog error (timeout or collective mismatch), or of ``what``
    else ended the job."""
    who = f"rank {rank}" if rank is not None else "a rank"
    return f"pympar: {who}: {what}: {err}; aborting the job"


ABORT_GRACE_S = 1.0


def abort_job(err: BaseException, status: int = ABORT_STATUS, what: str = "collective watchdog"):
    """Print the report on stderr and end every rank of the job (MPI_Abort on COMM_WORLD)."""
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(2, (report(err, rank, what) + "\n").encode(errors="backslashreplace"))
    # give the launcher a moment to forward the report: MPI_Abort tears the job down at once,
    # and output still in the launcher's pipes can be lost with it
    time.sleep(ABORT_GRACE_S)
    MPI.COMM_WORLD.Abort(status)
    os._exit(status)   # not reached: Abort does not return


class DeadlineGuard:
    """The deadline of a blocking library call, which cannot be polled: one daemon thread per
    process (started on first use) wakes every WATCH_SECONDS and, when one armed call has been
    in progress for longer than its communicator's timeout, builds the call's CommTimeoutError
    (who did not arrive, from the arrival board) and hands it to ``on_expiry`` -- abort_job
    below: the report on stderr and MPI_Abort for every rank (mpi4py and pympar's C path
    release the GIL inside MPI calls, so the thread runs).

    Arming is stores into ``SLOT`` (``[token, seq, generation]``: the communicator's token, the
    call's count and its Waiter's generation, which Waiter.renew changes where one operation's
    Waiter serves several waits -- auto's measurement), disarming one (token 0) -- Python
    (MPIComm) and C (csrc/fastcoll.cpp) write the same words (a planned call token and seq only:
    its seq is new).
    The clock is read here, not by the caller: the deadline counts from the
    first wake that sees the call, so it passes between timeout and timeout + WATCH_SECONDS
    after the call began, never before. ``watch(token, comm)`` names a token's communicator
    (held weakly)."""

    WATCH_SECONDS = 0.05

    def __init__(self, on_expiry):
        self._on_expiry, self._thread = on_expiry, None
        self._comms = weakref.WeakValueDictionary()   # token -> MPIComm

    def watch(self, token: int, comm):
        self._comms[token] = comm

    def start(self):
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="pympar-deadline", daemon=True)
            self._thread.start()

    def _watch(self):
        seen, since = None, 0.0
        while True:
            token = SLOT[0]
            call = (token, SLOT[1], SLOT[2]) if token else None
            if call is None or call != seen:
                seen, since = call, time.monotonic()
            else:
                c = self._comms.get(token)
                if c is not None and time.monotonic() - since > c.timeout:
                    self._expire(c, call)
                    seen = None
            time.sleep(self.WATCH_SECONDS)

    def _expire(self, c, call):
        board = c._board
        op = board.names.get(board.slots[1], "collective")
        try:
            Waiter(op, c.name, call[1], c.timeout, board).expire([], [], act=False)
        except CommTimeoutError as e:
            if (SLOT[0], SLOT[1], SLOT[2]) == call:    # still the same call, still stuck
                self._on_expiry(e)




_guard = None


def deadline_guard() -> DeadlineGuard:
    global _guard
    if _guard is None:
        _guard = DeadlineGuard(abort_job)
        _guard.start()
    return _guard
