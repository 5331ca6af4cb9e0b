"""Two computations interleaved at their communication: one's exchange in flight while the other computes.

DualPipeV (pp/schedules.py) pairs one micro-batch's forward with another's backward so that, with
expert parallelism, the all-to-all of one runs behind the compute of the other (DeepSeek-V3's
overlap). pympar's layers are plain call chains (GPT -> Block -> MoE -> ExpertParallel), so the
pair cannot be split into steps by hand without rewriting every layer as a state machine. Instead
``interleave(first, second)`` runs the two as strands: greenlets (coroutines with their own stacks,
switched in user space on this one thread), exactly one running at a time. Control passes only
inside ``exchange``: a strand starts its nonblocking exchange, hands over to its partner, and
completes the exchange when control comes back -- after the partner computed up to its own next
exchange (or finished).

One OS thread, so: MPI is called from the thread that initialised it, the kernels' thread pools
and a GPU's current device and stream are the same for both strands, signals arrive where they
always do, and a hand-over costs a few microseconds (OS threads handing over through a semaphore
cost a scheduler wake-up: about a millisecond each with 4 ranks on 2 cores, measured; that made a
pair slower than its two actions run one after the other).

What the overlap guarantees:
  * the same results, bitwise: each strand runs its own operations in its own order on its own
    activations (another micro-batch or chunk); a forward adds to no gradient, so every gradient
    gets the backward's additions in the order it had (each strand has its own deferred-W scopes:
    a greenlet has its own context variables, nn/wgrad.py);
  * the same order of collectives on every rank of a group: control passes at the same points
    on every rank (the ranks of an ep group hold the same layers and run the same schedule), so
    nonblocking collectives start in one order everywhere, as MPI requires;
  * outside a pair, ``exchange`` is the blocking call itself (no request, no switch).

What is hidden: the time a rank would wait in the exchange for its peers to arrive (their skew)
and the transfer where the library progresses it in the background; the copies an MPI library
makes only inside its calls stay on the critical path (the CPU has no engine doing them).
``exchange`` returns the seconds the strand itself spent in the exchange (its start and its wait,
not the partner's run): the exposed communication time the benchmarks compare.
"""

from __future__ import annotations

import contextvars
import time

import greenlet

from ..comm import progress


class _Pair:
    __slots__ = ("driver", "strands", "away")

    def __init__(self, driver):
        self.driver = driver                 # the caller's greenlet: it runs the turns
        self.strands = []
        self.away = {}                       # strand -> seconds it spent handed over to its partner


_PAIR = None                                 # the interleaved pair running now (one per process)


def active() -> bool:
    """Is this code running in a strand of an interleaved pair whose partner still runs?"""
    pair = _PAIR
    if pair is None:
        return False
    me = greenlet.getcurrent()
    return me in pair.strands and any(g is not me and not g.dead for g in pair.strands)


def exchange(blocking, start):
    """Run one exchange -> (its result, the seconds this strand spent in it). ``blocking()``: the
    blocking call; ``start()``: the same exchange started nonblocking (a Request whose wait()
    returns what blocking() returns). Inside an interleaved pair the partner runs between the
    start and the wait; elsewhere blocking() runs."""
    t0 = clock()
    if not active():
        out = blocking()
        return out, clock() - t0
    req = start()
    pair, me = _PAIR, greenlet.getcurrent()
    progress.behind(req)                     # moved on at the partner's compute seams (comm.progress.poke)
    t1 = time.perf_counter()
    try:
        pair.driver.switch()                 # the partner's turn, up to its next exchange or its end
    finally:                                 # (also when the pair ends this strand early: GreenletExit)
        progress.forget(req)
        pair.away[me] = pair.away.get(me, 0.0) + (time.perf_counter() - t1)
    out = req.wait()
    return out, clock() - t0                 # (the partner's turn left out)


def clock() -> float:
    """time.perf_counter() less the seconds this strand spent handed over to its partner: the
    difference of two readings is the strand's own time between them (outside a pair, perf_counter)."""
    pair = _PAIR
    t = time.perf_counter()
    if pair is None or not pair.away:
        return t
    return t - pair.away.get(greenlet.getcurrent(), 0.0)


def interleave(first, second, on_turn=None):
    """Run first() and second(), one at a time, control passing at every ``exchange`` of either,
    first() first. Returns (first's result, second's result, first's seconds running, second's
    seconds running) -- each strand's own time, without its partner's turns. on_turn(strand,
    start, seconds), if given, is called after each turn (strand 0: first, 1: second; start a
    time.perf_counter() reading): the turns laid out in time, as a profiler's trace shows them.
    An exception of either is raised here after both ended (the other runs to its end, its
    exchanges blocking; the second strand's exception is chained when both raise). Each strand
    starts in a copy of the caller's context variables (its own changes stay its own)."""
    global _PAIR
    if _PAIR is not None:
        raise RuntimeError("interleave: a strand of an interleaved pair cannot start another pair")
    pair = _Pair(greenlet.getcurrent())
    pair.strands = [greenlet.greenlet(first), greenlet.greenlet(second)]
    for g in pair.strands:
        g.gr_context = contextvars.copy_context()
    out, err, secs = [None, None], [None, None], [0.0, 0.0]
    _PAIR = pair
    try:
        turn = 0
        while not all(g.dead for g in pair.strands):
            g = pair.strands[turn]
            if not g.dead:
                t = time.perf_counter()
                try:
                    r = g.switch()           # back here at its next exchange, or its end
                except Exception as e:       # noqa: BLE001 -- raised below, after the partner ends
                    err[turn] = e
                dt = time.perf_counter() - t
                secs[turn] += dt
                if on_turn is not None:
                    on_turn(turn, t, dt)
                if g.dead and err[turn] is None:
                    out[turn] = r
            turn = 1 - turn
    finally:                                 # (KeyboardInterrupt and the like: the strands end here)
        _PAIR = None
        for g in pair.strands:
            if not g.dead:
                g.throw(greenlet.GreenletExit)
    if err[0] is not None and err[1] is not None:
        raise err[1] from err[0]
    for e in err:
        if e is not None:
            raise e
    return out[0], out[1], secs[0], secs[1]
