"""What a step's parallel parts spent communicating, told to whoever owns the meter.

A ``Meter`` is handed to each part that communicates on the model's behalf when that part is
built or installed: the tensor-parallel collectives (``TPCollectives(comm, meter=...)``), the
context-parallel ring (``install_context_parallel(..., meter=...)``) and the expert all-to-alls
(``install_expert_parallel(..., meter=...)``). Each part adds its seconds, bytes and calls under
its own key; the owner (the runner, once per step) takes the totals, which resets them. No part
reads another's counters, and nothing is read off a module after the step.

Keys: "tp" (seconds inside TP collectives: a blocking call's whole time, a nonblocking one's
start and wait), "cp wait" (seconds the ring attention waited for K/V transfers), "cp compute"
(seconds of the ring attention's block computation), ("ep", layer) (seconds inside the layer's
alltoall/alltoallv calls, bytes sent into them).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Tally:
    seconds: float = 0.0
    bytes: int = 0
    calls: int = 0


class Meter:
    def __init__(self):
        self._tallies: dict = {}

    def add(self, key, seconds: float, nbytes: int = 0, calls: int = 1) -> None:
        t = self._tallies.get(key)
        if t is None:
            t = self._tallies[key] = Tally()
        t.seconds += seconds
        t.bytes += int(nbytes)
        t.calls += calls

    def get(self, key) -> Tally:
        """The tally of ``key`` so far (a zero Tally when nothing was added), without resetting."""
        return self._tallies.get(key, Tally())

    def take(self, keep=None) -> dict:
        """{key: Tally} since the last take, reset. keep(key) -> bool: only those keys are taken
        (and reset); the others stay for their owner."""
        if keep is None:
            out, self._tallies = self._tallies, {}
            return out
        return {k: self._tallies.pop(k) for k in [k for k in self._tallies if keep(k)]}


def seconds(tallies: dict, key) -> float:
    """The seconds of ``key`` in a ``Meter.take()`` result (0 when it is absent)."""
    t = tallies.get(key)
    return 0.0 if t is None else t.seconds
