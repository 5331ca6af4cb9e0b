"""The tensor-parallel collectives, timed: Megatron's conjugate pairs and the sequence-parallel ones.

Every TP module talks to its tp group through one ``TPCollectives`` object, which adds the
seconds spent inside collectives, the number of calls and the bytes sent into them to its
``meter`` under "tp" (pympar.parallel.meter; the trainer passes its own, so it can report
``tp_comm_fraction``).

Sequence-parallel layout: activations (B, T, C) are split along T into tp equal parts; rank r
holds rows [r*T/tp, (r+1)*T/tp) of every sequence. ``allgather_seq`` and ``reduce_scatter_seq``
move between that and the full (B, T, C).
"""
from __future__ import annotations

import time

from ...backend import xp_of
from ..meter import Meter


class TPCollectives:
    def __init__(self, comm, algo="auto", meter: Meter | None = None):
        """algo: the Communicator's algorithm for every TP collective ('auto' lets it choose);
        meter: where the collectives' seconds, calls and bytes go (key "tp"; a new Meter if None)."""
        if isinstance(comm, TPCollectives):
            raise TypeError("TPCollectives wraps a Communicator, not another TPCollectives")
        self.comm, self.algo = comm, algo
        self.size = comm.size
        self.rank = comm.rank
        self.meter = Meter() if meter is None else meter

    def _timed(self, fn, x, *args, **kw):
        t0 = time.perf_counter()
        out = fn(x, *args, **kw)
        self.meter.add("tp", time.perf_counter() - t0, x.nbytes)
        return out

    # --- plain collectives on contiguous arrays -------------------------------------------------
    def allreduce(self, x, op="sum"):
        """The elementwise reduction over the tp group (a new array; x untouched)."""
        if self.size == 1:
            return x
        x = xp_of(x).ascontiguousarray(x)
        return self._timed(lambda a: self.comm.allreduce(a, op=op, algo=self.algo, inplace=False), x)

    def allreduce_start(self, x):
        """Start an in-place sum of x over tp; the returned handle's ``wait()`` gives it.
        Falls back to a blocking allreduce when the Communicator has no iallreduce. Only the
        time spent starting and waiting counts (communication hidden behind compute is free)."""
        if self.size == 1:
            return _Done(x)
        x = xp_of(x).ascontiguousarray(x)
        if not hasattr(self.comm, "iallreduce"):
            return _Done(self.allreduce(x))
        req = self._timed(self.comm.iallreduce, x)
        return _Timed(req, self)

    def allgather0(self, x):
        """(n, ...) per rank -> (size*n, ...), rank order along axis 0."""
        if self.size == 1:
            return x
        xp = xp_of(x)
        x = xp.ascontiguousarray(x)
        out = self._timed(self.comm.allgather, x, algo=self.algo)
        return xp.asarray(out).reshape((self.size * x.shape[0],) + x.shape[1:])

    def reduce_scatter0(self, x):
        """(size*n, ...) per rank -> (n, ...): the sum over ranks of this rank's block of axis 0."""
        if self.size == 1:
            return x
        xp = xp_of(x)
        x = xp.ascontiguousarray(x)
        n = x.shape[0] // self.size
        out = self._timed(self.comm.reduce_scatter, x, algo=self.algo)
        return xp.asarray(out).reshape((n,) + x.shape[1:])

    # --- along the sequence axis (sequence parallelism) --------------------------------------------
    def seq_slice(self, T: int) -> slice:
        w = T // self.size
        return slice(self.rank * w, (self.rank + 1) * w)

    def allgather_seq(self, x):                  # x (B, T/tp, C) -> (B, T, C)
        if self.size == 1:
            return x
        B, t, C = x.shape
        xp = xp_of(x)
        g = self.allgather0(xp.ascontiguousarray(x.transpose(1, 0, 2)))   # (tp*t, B, C)
        return xp.ascontiguousarray(g.transpose(1, 0, 2))

    def reduce_scatter_seq(self, x):             # x (B, T, C) partial sums -> (B, T/tp, C) summed
        if self.size == 1:
            return x
        B, T, C = x.shape
        if T % self.size:
            raise ValueError(f"sequence length T={T} is not divisible by tp={self.size} (sequence parallelism)")
        xp = xp_of(x)
        r = self.reduce_scatter0(xp.ascontiguousarray(x.transpose(1, 0, 2)))  # (T/tp, B, C)
        return xp.ascontiguousarray(r.transpose(1, 0, 2))

    def split_seq(self, x):                      # x (B, T, C) replicated -> (B, T/tp, C), no comm
        if self.size == 1:
            return x
        return xp_of(x).ascontiguousarray(x[:, self.seq_slice(x.shape[1])])


class _Done:
    def __init__(self, x):
        self.x = x

    def wait(self):
        return self.x


class _Timed:
    def __init__(self, req, tpc):
        self.req, self.tpc = req, tpc

    def wait(self):
        t0 = time.perf_counter()
        out = self.req.wait()
        self.tpc.meter.add("tp", time.perf_counter() - t0, calls=0)
        return out


def as_collectives(comm_or_tpc) -> TPCollectives:
    """Accept a Communicator (wrapped once) or an existing TPCollectives (shared counters)."""
    return comm_or_tpc if isinstance(comm_or_tpc, TPCollectives) else TPCollectives(comm_or_tpc)
