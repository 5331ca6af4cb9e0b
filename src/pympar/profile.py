"""The merged Chrome trace of every rank's recorded events.

The events come from each rank's ``Recorder`` (pympar/parallel/recorder.py: the time split
and, when profiling is on, every event); ``write_chrome_trace`` turns the events of all ranks
(gathered by the caller) into one Chrome trace JSON: one process row per rank, one thread row
per kind of work, openable in Perfetto (ui.perfetto.dev) or chrome://tracing.
"""
from __future__ import annotations

import json

from .parallel.recorder import SPLIT, Recorder

__all__ = ["SPLIT", "Recorder", "chrome_trace", "write_chrome_trace"]

_THREADS = {"compute": 0, "optimizer": 0, "bubble": 0, "wait": 0,
            "dp_comm": 1, "tp_comm": 1, "pp_comm": 1, "ep_comm": 1, "cp_comm": 1, "step": 2, "eval": 2}
_THREAD_NAMES = {0: "compute", 1: "communication", 2: "steps"}


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
