"""Event recorder for the time split (and, when enabled, the events of a Chrome trace).

Every rank owns one ``Recorder``; the trainer makes it and passes it to the runner. Code that
does work wraps it in ``with rec.span("fwd L3 mb1", "compute", bytes=...):`` (or calls
``rec.add`` with times it measured itself). The recorder always sums durations per category --
the per-step time split of metrics.jsonl -- and, when enabled, also keeps every event
(``pympar.profile`` writes them as a trace).

Categories (the keys of the time split): compute, dp_comm, tp_comm, pp_comm, ep_comm,
cp_comm (waiting for the context-parallel ring), bubble, optimizer. Other categories (``step``,
``eval``, ``wait``, ``micro``, ``layer``) are recorded but not summed into the split.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

SPLIT = ("compute", "dp_comm", "tp_comm", "pp_comm", "ep_comm", "cp_comm", "bubble", "optimizer")


class Recorder:
    """Cheap per-rank recorder: per-category totals always, events only when enabled."""

    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self.events: list[tuple] = []      # (name, cat, t0 s, dur s, args or None)
        self.totals = dict.fromkeys(SPLIT, 0.0)
        self.origin = time.perf_counter()

    def reset_origin(self) -> None:
        """Call right after a barrier so that every rank's clock starts at the same moment."""
        self.origin = time.perf_counter()

    def add(self, name: str, cat: str, t0: float, dur: float, **args) -> None:
        """Record a finished piece of work: t0 from time.perf_counter(), dur in seconds."""
        if cat in self.totals:
            self.totals[cat] += dur
        if self.enabled:
            self.events.append((name, cat, t0 - self.origin, dur, args or None))

    @contextmanager
    def span(self, name: str, cat: str, **args):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, cat, t0, time.perf_counter() - t0, **args)

    def take_totals(self) -> dict:
        """The per-category seconds since the last call (and reset them)."""
        out, self.totals = self.totals, dict.fromkeys(SPLIT, 0.0)
        return out
