"""Event recorder for the time split and the merged Chrome trace.

Every rank owns one ``Recorder``. Code that does work wraps it in
``with rec.span("fwd L3 mb1", "compute", bytes=...):`` (or calls ``rec.add`` with times it
measured itself). The recorder always sums durations per category -- that is the per-step
time split of metrics.jsonl -- and, when profiling is on, also keeps every event.
``write_chrome_trace`` turns the events of all ranks (gathered by the caller) into one
Chrome trace JSON: one process row per rank, one thread row per kind of work, openable in
Perfetto (ui.perfetto.dev) or chrome://tracing.

Categories (the keys of the time split): compute, dp_comm, tp_comm, pp_comm, ep_comm,
cp_comm (waiting for the context-parallel ring), bubble, optimizer. Other categories (``step``, ``eval``, ``wait``) are recorded but not summed
into the split.
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager

SPLIT = ("compute", "dp_comm", "tp_comm", "pp_comm", "ep_comm", "cp_comm", "bubble", "optimizer")
_THREADS = {"compute": 0, "optimizer": 0, "bubble": 0, "wait": 0,
            "dp_comm": 1, "tp_comm": 1, "pp_comm": 1, "ep_comm": 1, "cp_comm": 1, "step": 2, "eval": 2}
_THREAD_NAMES = {0: "compute", 1: "communication", 2: "steps"}


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


class _Null:
    """A recorder that records nothing (for code run outside the trainer)."""
    enabled = False

    def add(self, *a, **k):
        pass

    @contextmanager
    def span(self, *a, **k):
        yield


NULL = _Null()


def chrome_trace(events_by_rank: list[list[tuple]], rank_labels: list[str] | None = None) -> dict:
    """The Chrome trace-event JSON object for all ranks' events (pid = rank)."""
    out = []
    for rank, events in enumerate(events_by_rank):
        label = rank_labels[rank] if rank_labels else f"rank {rank}"
        out.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": label}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for tid, tname in _THREAD_NAMES.items():
            out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": tname}})
        for name, cat, t0, dur, args in events:
            ev = {"name": name, "cat": cat, "ph": "X", "pid": rank, "tid": _THREADS.get(cat, 0),
                  "ts": round(t0 * 1e6, 3), "dur": round(dur * 1e6, 3)}
            if args:
                ev["args"] = args
            out.append(ev)
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(path, events_by_rank, rank_labels=None) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(events_by_rank, rank_labels), f)
