"""Waiting on MPI requests with a deadline, cheaply.

Every blocking wait in pympar's own algorithms goes through :class:`Waiter`: it polls with
``Test`` (MPICH progresses transfers inside those calls), yields the core after a burst of
spins so oversubscribed ranks are not starved, sleeps in short steps once a wait is clearly
long, and raises :class:`CommTimeoutError` naming the peers not heard from at the deadline.
"""
from __future__ import annotations

import itertools
import math
import os
import time

from .lazympi import MPI

from .errors import CommTimeoutError
from .settings import SETTINGS

SPINS_BEFORE_YIELD = 200      # tight Test calls first: most waits end in microseconds
SPINS_OVERSUBSCRIBED = 4      # ... unless this node runs more ranks than cores: then the peer
                              # we wait for needs our core, so yield almost at once
YIELD_SECONDS = 0.02          # then sched_yield between tests for this long
MAX_SLEEP = 1e-3              # then sleep, doubling from 20 us up to this


def affinity() -> list:
    """The cores this process may run on (all of them where the OS does not say)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


PACE = memoryview(bytearray(16)).cast("q")  # [spins, 1 where an abort-mode wait blocks in the library]:
PACE[0] = SPINS_BEFORE_YIELD                # the pace, read at each wait here and by the C path (fastcoll.cpp)
_job_local = 0                # the launcher's count of this job's ranks on this node (0: unknown)
_union = 0                    # the most cores a communicator's ranks on this host were seen to share


def note_local_ranks(n: int, cores: int | None = None) -> None:
    """Tell the polling pace how many ranks share this node (Topology calls it with its node's
    ranks, or the job's when more) and, when known, how many cores they may use together (the union
    of their affinity masks: a launcher that binds each rank to its own core leaves each process one
    core, yet no two ranks share one). More ranks than cores -> yield after a few tests."""
    global _union
    _union = max(_union, cores or 0)         # the widest communicator's union counts (the world's)
    over = n > max(_union, len(affinity()))
    PACE[0], PACE[1] = (SPINS_OVERSUBSCRIBED, 0) if over else (SPINS_BEFORE_YIELD, 1)   # (PACE[1]: 0 until told)


def note_job_local_ranks(n: int) -> None:
    """The launcher's count of this job's ranks on this node (the application's edge reads it from
    the launcher's variables): the pace from now on, and a floor for what Topology notes later."""
    global _job_local
    _job_local = int(n)
    note_local_ranks(_job_local)


def job_local_ranks() -> int:
    return _job_local


def oversubscribed() -> bool:
    return PACE[0] == SPINS_OVERSUBSCRIBED


def blocks(token: int) -> bool:
    """Does a long collective wait of a communicator with this deadline-guard token (0: none, an
    on_timeout="raise" one) block inside the library? Not while the node runs more ranks than cores,
    or before anyone told the pace how many it runs (Waiter)."""
    return bool(token) and bool(PACE[1])


def default_timeout() -> float:
    """The communicators' timeout when none is given (pympar.comm.settings; 300 s unless configured)."""
    return SETTINGS.timeout


# --- progress during compute -----------------------------------------------------------------
# An MPI library without a progress thread moves a nonblocking operation's data only inside MPI
# calls. A computation that has an exchange in flight behind it (parallel/overlap.py: one strand's
# all-to-all while the other strand computes) registers the request here; the compute's natural
# seams (each product, each layer's pieces) call ``poke()``, which tests them, so the peers' data
# moves while this rank computes, not only when it waits.
_BEHIND = []                  # requests in flight behind the compute now running


def behind(req) -> None:
    """Test ``req`` at every poke() until forget(req)."""
    _BEHIND.append(req)


def forget(req) -> None:
    if req in _BEHIND:
        _BEHIND.remove(req)


def poke() -> None:
    """Let the library move the requests in flight behind this compute (nothing when there are none).
    Only the messages already started move (``Request.nudge``): a staged request's next stage starts
    where its owner tests or waits, at the same point on every rank, never at a product whose timing
    differs between ranks. A request whose started messages are all done is let go."""
    if _BEHIND:
        for r in list(_BEHIND):
            nudge = getattr(r, "nudge", None)    # (a request without it moves at its wait)
            if nudge is None or nudge():
                _BEHIND.remove(r)


class Backoff:
    """Polling pace: tight spins (a few when the node is oversubscribed), then sched_yield for
    YIELD_SECONDS, then doubling sleeps.

    ``pause()`` returns the current time when it checked the clock (None while spinning, and
    on 15 of every 16 yields: reading the clock costs as much as the yield's bookkeeping).
    """

    __slots__ = ("spins", "sleep", "yield_until", "limit")

    def __init__(self, sleeping=False):
        """sleeping: the spins and yields were done elsewhere (the C path): start with the sleeps."""
        self.spins, self.sleep, self.yield_until, self.limit = 0, 2e-5, None, PACE[0]
        if sleeping:
            self.spins, self.yield_until = self.limit, 0.0

    def pause(self):
        self.spins += 1
        if self.spins < self.limit:
            return None
        if self.spins & 15 and self.yield_until and self.sleep == 2e-5:
            os.sched_yield()     # in the yield phase: the clock every 16th pause only
            return None
        now = time.monotonic()
        if self.yield_until is None:
            self.yield_until = now + YIELD_SECONDS
        if now < self.yield_until:
            os.sched_yield()
        else:
            time.sleep(self.sleep)
            self.sleep = min(self.sleep * 2, MAX_SLEEP)
        return now


def poll1(req, waiter_factory, peer=None):
    """Wait for one MPI request: tight Tests first, then ``waiter_factory().wait`` (the deadline,
    backoff and the watchdog report) -- the Waiter is built only when the wait is not short.
    peer: the rank a point-to-point request waits on (named, and the request withdrawn, at expiry)."""
    test = req.Test
    for _ in range(PACE[0]):
        if test():
            return
    waiter_factory().wait([req], [peer])


SLOT = memoryview(bytearray(24)).cast("q")   # [token, seq, generation] of the blocking call in progress
                                            # (token 0: none): watched by watchdog.DeadlineGuard, written by
                                            # callers (a planned call, Python or C, token and seq: its seq is new)
_GENERATION = itertools.count(1)             # a renewed Waiter's generation (Waiter.renew)


def block(reqs, token: int, seq: int, gen: int = 0) -> None:
    """MPI_Waitall(reqs) inside the library (mpi4py releases the GIL), its deadline kept off the
    critical path: the deadline guard's slot is armed with the communicator's token, the call's
    number and its Waiter's generation, and the guard's thread ends the job with the report if the
    call outlives its timeout (counted from the first time the guard sees that slot)."""
    SLOT[2] = gen
    SLOT[1] = seq
    SLOT[0] = token
    try:
        MPI.Request.Waitall(reqs)
    finally:
        SLOT[0] = 0


class Waiter:
    """Deadline of one operation: ``wait(reqs, peers)`` blocks until all complete or it expires.

    ``token`` (a collective of a communicator made with on_timeout="abort", whose deadline guard
    knows the token): a wait that outlives a short burst of tests blocks inside the MPI library
    (``block``) instead of polling from Python -- the same outcome at the deadline (the job ends
    with the report), and the library's own progress loop (an 8 MiB alltoallv at 2 ranks: 1.78 ms
    against 3.04 polled, measured) -- unless the node runs more ranks than cores: a rank blocked
    in the library spins there and would starve the peer it waits for, so it polls and yields
    (as it does until the pace knows how many ranks share the node: note_local_ranks)."""

    __slots__ = ("op", "comm_name", "seq", "timeout", "deadline", "board", "token", "gen")

    def __init__(self, op: str, comm_name: str, seq: int, timeout: float, board=None, token: int = 0):
        self.op, self.comm_name, self.seq, self.timeout = op, comm_name, seq, timeout
        self.board = board    # watchdog.ArrivalBoard of a collective: names who never entered it
        self.token = token
        self.deadline = time.monotonic() + timeout if math.isfinite(timeout) else math.inf
        self.gen = 0          # the deadline guard tells a renewed Waiter's waits from the earlier ones

    def renew(self) -> None:
        """A fresh deadline, timeout seconds from now, for the polled waits and -- a new generation in
        the guard's slot -- for those blocking in the library: auto's measurement (tuning.measure)
        runs many calls under one operation's Waiter, and its timeout bounds each round, not their sum."""
        if math.isfinite(self.timeout):
            self.deadline = time.monotonic() + self.timeout
        self.gen = next(_GENERATION)

    def blocks(self) -> bool:
        """Does a long wait of this operation block inside the library (see the class)?"""
        return blocks(self.token)

    def wait1(self, req, peer):
        if req.Test():
            return
        self.wait([req], [peer])

    def wait(self, reqs, peers, yielded=False):
        """yielded: the caller already tested between yields for YIELD_SECONDS (the C path,
        fastcoll.cpp): the pace goes on from its sleeps."""
        if not reqs:
            return
        if self.blocks():
            testall = MPI.Request.Testall
            for _ in range(PACE[0]):
                if testall(reqs):
                    return
            block(reqs, self.token, self.seq, self.gen)
            return
        pace = Backoff(sleeping=yielded)
        if len(reqs) == 1:
            test = reqs[0].Test
            while not test():
                now = pace.pause()
                if now is not None and now > self.deadline:
                    self.expire(reqs, peers)
            return
        testall = MPI.Request.Testall
        while not testall(reqs):
            now = pace.pause()
            if now is not None and now > self.deadline:
                self.expire(reqs, peers)

    def expire(self, reqs, peers, detail="", act=True):
        """The deadline passed: the CommTimeoutError naming who did not arrive, handed to fail()
        (act=False: raised as it is, for the deadline guard, which decides itself)."""
        pending = [p for r, p in zip(reqs, peers) if r != MPI.REQUEST_NULL and not r.Test()]
        for r, p in zip(reqs, peers):  # withdraw point-to-point requests (collectives cannot be)
            if r != MPI.REQUEST_NULL and p is not None:
                try:
                    r.Cancel()
                except MPI.Exception:
                    pass
        if self.board is not None:   # ask the peers which call they are in (bounded, see watchdog.py)
            missing, notes = self.board.missing(self.seq, self.op)
            peers_left = sorted(set(p for p in pending if p is not None))
            if peers_left:
                notes.append("waiting on rank(s) " + ", ".join(map(str, peers_left)))
            pending = missing or pending
            detail = "; ".join(([detail] if detail else []) + notes)
        err = CommTimeoutError(self.op, self.comm_name, self.seq, pending, self.timeout, detail)
        if act:
            self.fail(err)
        raise err

    def fail(self, err):
        """Act on this wait's timeout: raise err in the caller, or -- a communicator made with
        on_timeout="abort" (its board says so) -- end the job with the report (watchdog.abort_job)."""
        if self.board is not None:
            self.board.timed_out(err)
        raise err


class Request:
    """A pending operation: ``wait()`` returns its result, ``test()`` says whether it is done.

    ``finish`` runs once on completion (divide for avg, copy a result into place).
    """

    def __init__(self, reqs, peers, waiter: Waiter, finish=None, result=None):
        self._reqs, self._peers, self._waiter = list(reqs), list(peers), waiter
        self._finish, self._result, self._done = finish, result, False

    def _complete(self):
        if not self._done:
            self._done = True
            if self._finish is not None:
                self._finish()
        return self._result

    def wait(self):
        if not self._done:
            self._waiter.wait(self._reqs, self._peers)
        return self._complete()

    def nudge(self) -> bool:
        """Let the library move the messages this operation has started (MPI_Testall): nothing
        completes here (no finish, no next stage) and no deadline is checked. True when they are done."""
        return bool(MPI.Request.Testall(self._reqs)) if self._reqs else True

    def test(self) -> bool:
        """Progress the operation once; True when it is complete. Past the deadline a test
        raises CommTimeoutError like wait() would (a polled request cannot hang silently)."""
        if self._done:
            return True
        if MPI.Request.Testall(self._reqs):
            self._complete()
            return True
        self._check_deadline()
        return False

    def _check_deadline(self):
        w = self._waiter
        if w is not None and w.deadline != math.inf and time.monotonic() > w.deadline:
            w.expire(self._reqs, self._peers)


class P2PRequest(Request):
    """One point-to-point MPI request, lean: the Waiter (deadline object, backoff, report) is
    built only when wait() is not short; test() past the deadline raises as Request's does.
    make_waiter(): the Waiter of this operation, deadline counted from the request's start."""


    def __init__(self, req, peer, make_waiter, result):
        self._reqs, self._peers, self._waiter = (req,), (peer,), make_waiter
        self._finish, self._result, self._done = None, result, False

    def wait(self):
        if not self._done:
            poll1(self._reqs[0], self._waiter, self._peers[0])
            self._done = True
        return self._result

    def test(self) -> bool:
        if self._done:
            return True
        if self._reqs[0].Test():
            self._done = True
            return True
        w = self._waiter()
        if w.deadline != math.inf and time.monotonic() > w.deadline:
            w.expire(list(self._reqs), list(self._peers))
        return False


class StagedRequest(Request):
    """A nonblocking operation run as a state machine: ``steps`` is a generator that yields
    (MPI requests, their peers) of the stage in flight and returns the result. ``test()`` moves it
    on while stages complete; ``wait()`` drives it to the end against the deadline.

    ``inflight``: the communicator's list of unfinished staged requests. While one waits, it
    moves all of them on, so ranks that wait for their requests in different orders still
    progress the ones their peers wait for (MPI gives its own nonblocking collectives that
    guarantee; pympar's algorithms get it here)."""

    tagged = False           # its messages carry a tag of the communicator's call numbering

    def __init__(self, steps, waiter: Waiter, finish=None, inflight=None):
        super().__init__([], [], waiter, finish, None)
        self._steps, self._inflight = steps, inflight
        if not self._advance() and inflight is not None:
            inflight.append(self)

    @property
    def seq(self) -> int:
        """The call's number on its communicator (its message tag derives from it)."""
        return self._waiter.seq

    def _advance(self) -> bool:
        while not self._done:
            if self._reqs and not MPI.Request.Testall(self._reqs):
                return False
            try:
                reqs, peers = next(self._steps)
                self._reqs, self._peers = list(reqs), list(peers)
            except StopIteration as stop:
                self._reqs, self._result = [], stop.value
                self._complete()
                if self._inflight is not None and self in self._inflight:
                    self._inflight.remove(self)
        return True

    def test(self) -> bool:
        if self._advance():
            return True
        self._check_deadline()
        return False

    def wait(self):
        w = self._waiter
        if w.blocks() and not any(o is not self for o in (self._inflight or ())):
            while not self._advance():               # nothing else of pympar's to move on meanwhile
                w.wait(self._reqs, self._peers)
            return self._result
        pace = Backoff()
        while not self._advance():
            for other in list(self._inflight or ()):
                if other is not self:
                    other._advance()
            now = pace.pause()
            if now is not None and now > self._waiter.deadline:
                self._waiter.expire(self._reqs, self._peers)
        return self._result


def drive(waiter: Waiter, steps):
    """Run a staged operation (see StagedRequest) to the end, blocking; returns its result."""
    try:
        while True:
            reqs, peers = next(steps)
            waiter.wait(reqs, peers)
    except StopIteration as stop:
        return stop.value


class DoneRequest(Request):
    """An operation that completed when it was issued (size-1 communicators, eager paths)."""

    def __init__(self, result=None):
        super().__init__([], [], None, None, result)
        self._done = True
