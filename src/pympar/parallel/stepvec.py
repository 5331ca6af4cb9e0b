"""The step's one world allreduce as named slots.

Every optimizer step ends with ONE allreduce (sum) of a float64 vector over the world
(pympar.parallel.runner): each rank writes what it alone contributes into named slots, zeros
elsewhere, and every rank reads the sums back by the same names. ``Slots`` is that vector's
layout: ``Slots([(name, size), ...])`` gives each name its offset once, so the writer and the
reader cannot disagree about where a value lives.

    slots = Slots([("loss", 1), ("load", E), ("memory", M)])
    vec = slots.zeros()
    slots.put(vec, "load", counts)          # this rank's share
    red = world_allreduce(vec)
    slots.get(red, "load")                  # the world's sum, a view
"""
from __future__ import annotations

import numpy as np


class Slots:
    def __init__(self, fields):
        self.offsets, at = {}, 0
        for name, size in fields:
            if name in self.offsets:
                raise ValueError(f"slot {name!r} named twice")
            self.offsets[name] = (at, int(size))
            at += int(size)
        self.size = at

    def zeros(self):
        return np.zeros(self.size, np.float64)  # host: the vector travels over MPI

    def get(self, vec, name):
        """The slot's values (a view of vec)."""
        at, n = self.offsets[name]
        return vec[at:at + n]

    def put(self, vec, name, values):
        at, n = self.offsets[name]
        vec[at:at + n] = np.asarray(values, np.float64).reshape(-1)  # host

    def scalar(self, vec, name) -> float:
        return float(self.get(vec, name)[0])
