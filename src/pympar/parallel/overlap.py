"""Two computations interleaved at their communication: one's exchange in flight while the other computes.

DualPipeV (pp/schedules.py) pairs one micro-batch's forward with another's backward so that, with
expert parallelism, the all-to-all of one runs behind the compute of the other (DeepSeek-V3's
overlap). pympar's layers are plain call chains (GPT -> Block -> MoE -> ExpertParallel), so the
pair cannot be split into steps by hand without rewriting every layer as a state machine. Instead
``interleave(first, second)`` runs the two as strands: ``first`` on the calling thread, ``second``
on a helper thread, exactly one of them running at any moment (a baton passes between them; the
other waits on a semaphore). Control passes only inside ``exchange``: a strand starts its
nonblocking exchange, hands the baton to its partner, and completes the exchange when the
partner hands it back -- after the partner computed up to its own next exchange (or finished).

What the overlap guarantees:
  * the same results, bitwise: each strand runs its own operations in its own order on its own
    activations (another micro-batch or chunk); a forward adds to no gradient, so every gradient
    gets the backward's additions in the order it had (each thread has its own deferred-W scope,
    nn/wgrad.py);
  * the same order of collectives on every rank of a group: control passes at the same points
    on every rank (the ranks of an ep group hold the same layers and run the same schedule), so
    nonblocking collectives start in one order everywhere, as MPI requires;
  * MPI is called by one thread at a time (MPI_THREAD_SERIALIZED would do; mpi4py asks for
    MULTIPLE);
  * outside a pair, ``exchange`` is the blocking call itself (no thread, no request).

What is hidden: the time a rank would wait in the exchange for its peers to arrive (their skew)
and the transfer where the library progresses it in the background; the copies an MPI library
makes only inside its wait calls stay on the critical path (the CPU has no engine doing them).
``exchange`` returns the seconds the strand itself spent in the exchange (its start and its wait,
not the partner's run): the exposed communication time the benchmarks compare.
"""
from __future__ import annotations

import threading
import time


class _Strand:
    __slots__ = ("go", "done", "partner", "active", "since")

    def __init__(self):
        self.go = threading.Semaphore(0)     # released when this strand may run
        self.done = False
        self.partner = None
        self.active = 0.0                    # seconds this strand held the baton
        self.since = 0.0

    def hand_over(self):
        """Give the baton to the partner (when it is still running) and wait until it comes back."""
        p = self.partner
        if p.done:
            return
        now = time.perf_counter()
        self.active += now - self.since
        p.since = now
        p.go.release()
        self.go.acquire()


_local = threading.local()


def _strand():
    return getattr(_local, "strand", None)


def active() -> bool:
    """Is this thread a strand of an interleaved pair whose partner still runs?"""
    s = _strand()
    return s is not None and not s.partner.done


def exchange(blocking, start):
    """Run one exchange -> (its result, the seconds this strand spent in it). ``blocking()``: the
    blocking call; ``start()``: the same exchange started nonblocking (a Request whose wait()
    returns what blocking() returns). Inside an interleaved pair the partner runs between the
    start and the wait; elsewhere blocking() runs."""
    t0 = time.perf_counter()
    if not active():
        out = blocking()
        return out, time.perf_counter() - t0
    req = start()
    t1 = time.perf_counter()
    _strand().hand_over()
    t2 = time.perf_counter()
    out = req.wait()
    return out, (t1 - t0) + (time.perf_counter() - t2)


def interleave(first, second):
    """Run first() and second(), one at a time, control passing at every ``exchange`` of either:
    first() on this thread, second() on a helper thread. Returns (first's result, second's result,
    first's seconds running, second's seconds running) -- each strand's own time, without the time
    it waited for the other. An exception of either is raised here after both ended."""
    if _strand() is not None:
        raise RuntimeError("interleave: a strand of an interleaved pair cannot start another pair")
    a, b = _Strand(), _Strand()
    a.partner, b.partner = b, a
    out, err = [None, None], [None, None]

    def helper():
        _local.strand = b
        b.go.acquire()                       # the first hand-over (or first's end)
        try:
            out[1] = second()
        except BaseException as e:           # raised on the calling thread
            err[1] = e
        finally:
            b.active += time.perf_counter() - b.since
            b.done = True
            _local.strand = None
            if not a.done:
                a.since = time.perf_counter()
                a.go.release()

    t = threading.Thread(target=helper, name="pympar-overlap", daemon=True)
    t.start()
    _local.strand = a
    a.since = time.perf_counter()
    try:
        out[0] = first()
    except BaseException as e:
        err[0] = e
    finally:
        a.active += time.perf_counter() - a.since
        a.done = True
        _local.strand = None
        if not b.done:
            b.since = time.perf_counter()
            b.go.release()                   # second runs to its end (its exchanges now block)
        t.join()
    for e in err:
        if e is not None:
            raise e
    return out[0], out[1], a.active, b.active
