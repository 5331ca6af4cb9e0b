"""One optimizer step's figures: what each rank adds, summed over the world in one allreduce,
and what the trainer reads.

Every optimizer step ends with ONE allreduce (sum) of a float64 vector over the world
(pympar.parallel.runner). ``StepShare`` is what one rank adds to it: each field is written by
the ranks that own that figure (the loss by tp rank 0 of the first stage, a MoE layer's load by
tp rank 0, every rank's memory at its own place), zeros elsewhere, so the world's sum is the
figure. The share packs itself into the vector and unpacks the sum into a share of the same
shape, by field names (``Slots``): the writer and the reader cannot disagree about where a value
lives, and a field added to the dataclass travels without an offset written anywhere.

    share = StepShare(loss=..., moe={0: MoeShare.zeros(E, ep)}, memory=...)
    slots = share.slots()
    total = share.unpack(world_allreduce(share.pack(slots)), slots)   # the same shape, holding the sums
    total.loss, total.moe[0].load

Every rank must build a share of the same shape (the same MoE layers, the same array sizes):
the vector's layout is derived from it. ``StepStats`` is the step's result, the same on every
rank: what the trainer logs and decides by (stop, publish a checkpoint, count a bad step).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass, replace

import numpy as np


class Slots:
    """A float64 vector's layout by name: ``Slots([(name, size), ...])`` gives each name its
    offset once."""

    def __init__(self, named_sizes):
        self.offsets, at = {}, 0
        for name, size in named_sizes:
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


def _leaves(obj, prefix=""):
    """(slot name, values as a flat float64 array) of a dataclass's fields, in field order;
    nested dataclasses and {key: dataclass} maps by dotted names (maps in key order)."""
    for f in fields(obj):
        v, name = getattr(obj, f.name), prefix + f.name
        if is_dataclass(v):
            yield from _leaves(v, name + ".")
        elif isinstance(v, dict):
            for k in sorted(v):
                yield from _leaves(v[k], f"{name}.{k}.")
        else:
            yield name, np.asarray(v, np.float64).reshape(-1)  # host


def _rebuild(obj, get, prefix=""):
    """obj's shape with every leaf read by ``get(slot name)``: scalars as floats, arrays in their shape."""
    new = {}
    for f in fields(obj):
        v, name = getattr(obj, f.name), prefix + f.name
        if is_dataclass(v):
            new[f.name] = _rebuild(v, get, name + ".")
        elif isinstance(v, dict):
            new[f.name] = {k: _rebuild(v[k], get, f"{name}.{k}.") for k in v}
        elif np.ndim(v) == 0:
            new[f.name] = float(get(name)[0])
        else:
            new[f.name] = np.array(get(name)).reshape(np.shape(v))  # host
    return replace(obj, **new)


class Packable:
    """A dataclass of numbers that packs itself into one float64 vector and unpacks a vector of
    the same layout (e.g. its sum over ranks) into an instance of the same shape."""

    def slots(self) -> Slots:
        return Slots((name, a.size) for name, a in _leaves(self))

    def pack(self, slots: Slots | None = None) -> np.ndarray:
        slots = self.slots() if slots is None else slots
        vec = slots.zeros()
        for name, a in _leaves(self):
            slots.put(vec, name, a)
        return vec

    def unpack(self, vec, slots: Slots | None = None):
        slots = self.slots() if slots is None else slots
        if np.size(vec) != slots.size:
            raise ValueError(f"a step vector of {np.size(vec)} values for a layout of {slots.size}")
        vec = np.asarray(vec, np.float64).reshape(-1)  # host
        return _rebuild(self, lambda name: slots.get(vec, name))


@dataclass
class MoeShare(Packable):
    """One MoE layer's part of the step vector."""
    load: np.ndarray                 # (E,) tokens routed to each expert (tp rank 0: routing is replicated over tp)
    rows: np.ndarray                 # (ep,) rows each ep rank's experts ran (summed over the ep groups)
    dropped: float = 0.0             # fraction of tokens over capacity (summed over dp x cp)
    a2a_s: float = 0.0               # the all-to-alls' seconds over the senders (a mean, pre-divided)
    a2a_bytes: float = 0.0

    @classmethod
    def zeros(cls, n_expert: int, ep: int):
        return cls(load=np.zeros(n_expert), rows=np.zeros(ep))  # host

    def summary(self, layer: int, dpcp: int, ep: int) -> dict:
        """The summed layer as the trainer's metrics record it."""
        from .replicas import max_over_mean

        st = dict(layer=layer, tokens_per_expert=[int(round(t)) for t in self.load],
                  dropped_fraction=self.dropped / dpcp)
        if ep > 1:
            st.update(a2a_seconds=self.a2a_s, a2a_bytes=int(round(self.a2a_bytes)),
                      rows_per_ep_rank=[int(round(t)) for t in self.rows], rank_max_over_mean=max_over_mean(self.rows))
        return st


@dataclass
class StepShare(Packable):
    """What one rank adds to the step's world sum (see the module docstring)."""
    loss: float = 0.0                # the mean micro-batch loss (one rank per dp x cp replica)
    nonfinite: float = 0.0           # non-finite gradient elements this rank owns
    norm_sq: float = 0.0             # the squared norm of the gradient elements this rank owns
    stop: float = 0.0                # 1: this rank was asked to stop (a signal)
    written: float = 0.0             # 1: this rank's part of a background checkpoint is on disk
    moe: dict = field(default_factory=dict)                          # layer -> MoeShare
    stage_times: np.ndarray = field(default_factory=lambda: np.zeros(0))   # host; --pp-costs measured: (S, 3)
    memory: np.ndarray = field(default_factory=lambda: np.zeros(0))        # host; ledger.memory_vector


@dataclass
class StepStats:
    """One optimizer step, the same on every rank (the trainer's record and decisions)."""
    loss: float                      # the global batch's mean loss: the single-process step's
    grad_norm: float                 # before clipping; nan when the step was skipped
    loss_scale: float
    skipped: bool                    # no update applied (a non-finite loss or gradient)
    nonfinite: bool
    stop: bool                       # some rank was asked to stop
    all_written: bool                # every rank's part of the background checkpoint is on disk
    moe: list = field(default_factory=list)          # per MoE layer: MoeShare.summary
    memory: dict = field(default_factory=dict)       # ledger.memory_summary: every rank's figures
    time_split: dict = field(default_factory=dict)   # seconds by category (Recorder.take_totals)
    cp_ring: dict = field(default_factory=dict)      # this rank's ring waits and busy time
    pipeline: dict = field(default_factory=dict)     # bubble, peak_in_flight, table_costs (pp > 1)
