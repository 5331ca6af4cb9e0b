"""Sums whose bits do not depend on the order or grouping of their terms.

A floating-point sum rounds after every addition, so (a + b) + c and a + (b + c) can differ in
the last bit: an allreduce's result depends on the algorithm's grouping, the number of ranks and
how each rank pre-summed its share. :class:`ExactSum` instead keeps, per element, the sum of its
terms as integers in fixed binary windows ("bins" of 32 bit positions, the same for every
process), so that adding terms, merging two partial sums, or reducing partial sums over ranks
with MPI's integer sum all give the same integers in any order; the float result is then one
deterministic function of those integers.

Each term x = m * 2^e (m an integer of at most 24 bits for float32; a float64 term is split in two
such parts) adds m * 2^e into the bins its bits fall in. An element keeps the K bins from the
highest bin any of its terms reached ("top") downwards (K = 3 for float32, 96 bits; 4 for float64,
128 bits); a part below them is dropped. Whether a part is kept depends only on the final top (the
largest over all terms), never on the order: a part dropped early lies below the final window, and
a bin dropped when the top rises would have been below it anyway (the idea of ReproBLAS's binned
sums, Demmel and Nguyen, here with integer bins). So the result is the exact sum of every term's
bits within 96 (128) bits of the largest term, summed in float64 with compensation and rounded to
the dtype: within an ulp of the sum (measured: the correctly rounded sum, math.fsum's, in float32
and float64 on terms spanning 40 decades), plus at most N * 2^-64 of the largest term for the
parts dropped below the window.

Bins hold int64 sums of 32-bit pieces: 2^31 contributions per element can be added before a bin
could overflow, and ``ExactSum`` counts them (adds, merges, sums over elements and ranks) and
refuses more. Carries are never moved between bins except in a copy read by ``value()``: a carry
moved early would survive a bin that a later, larger term pushes out of the window, and the bits
would then depend on the order. A non-finite term makes its element NaN, in any order. The integers travel through any
pympar communicator's integer allreduce or reduce_scatter (every algorithm is exact on
integers): :meth:`ExactSum.allreduce`, and ``allreduce(x, reproducible=True)`` on the
communicators.
"""
from __future__ import annotations

import numpy as np

from ..kernels.reference import EXACT_BAD as _BAD, EXACT_BIN as BIN, EXACT_NONE as _NONE

_KEPT = {np.dtype(np.float32): 3, np.dtype(np.float64): 4}    # bins kept per element (96 or 128 bits)
_MAX_TERMS = 1 << 31                  # contributions a bin can take before an int64 could overflow


def kept(dtype) -> int:
    d = np.dtype(dtype)
    if d not in _KEPT:
        raise TypeError(f"reproducible sums take float32 or float64 terms, not {d}")
    return _KEPT[d]


class ExactSum:
    """A reproducible running sum of float32 or float64 arrays of one shape (the module docstring).

    ``add(x)`` adds a term, ``merge(other)`` another partial sum, ``allreduce(comm)`` the partial
    sums of every rank of ``comm``; ``value()`` is the sum in the terms' dtype (the same bits for
    the same multiset of terms, however they were grouped)."""

    def __init__(self, shape, dtype=np.float32):
        self.dtype = np.dtype(dtype)
        self.K = kept(self.dtype)
        self.shape = tuple(np.empty(shape, np.int8).shape)
        n = int(np.prod(self.shape)) if self.shape else 1
        self.top = np.full(n, _NONE, np.int32)            # the bin of each element's largest term
        self.bins = np.zeros((n, self.K), np.int64)      # bins top, top-1, ..., top-K+1
        self._adds = 0

    @classmethod
    def _of(cls, dtype, shape, top, bins, adds=0):
        """A sum made of the given integers (taken, not copied)."""
        out = cls.__new__(cls)
        out.dtype, out.shape, out._adds = np.dtype(dtype), tuple(shape), adds
        out.K = kept(out.dtype)
        out.top = np.ascontiguousarray(top, np.int32).reshape(-1)
        out.bins = np.ascontiguousarray(bins, np.int64).reshape(len(out.top), out.K)
        return out

    # --- building ----------------------------------------------------------------------------
    def _raise_top(self, new_top):
        """Move every element's window up to new_top (>= top), dropping the bins that leave it."""
        from .. import kernels

        kernels.exact_raise(self.top, self.bins, np.ascontiguousarray(new_top, np.int32))

    def add(self, x):
        """Add the term x (this sum's dtype and shape). A non-finite element makes that element's
        sum NaN (its top becomes a sentinel above every bin, which merges and reductions carry as
        they carry any top), so no rank raises while the others wait in a reduction."""
        from .. import kernels

        x = np.asarray(x)
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        if x.dtype != self.dtype or x.shape != self.shape:
            raise ValueError(f"term {x.dtype} {x.shape} does not match the sum's {self.dtype} {self.shape}")
        flat = x.reshape(-1)
        bad = ~np.isfinite(flat)
        if bad.any():
            flat = np.where(bad, 0, flat)
        self._count(self._adds + 1)
        kernels.exact_add(flat, self.top, self.bins)
        if bad.any():
            self.top[bad] = _BAD
        return self

    def _count(self, adds):
        """Each bin takes less than 2^32 per contribution into an int64: refuse what could overflow."""
        if adds >= _MAX_TERMS:
            raise OverflowError(f"a reproducible sum of {adds} contributions per element could overflow its int64 "
                                f"bins (at most 2^31 - 1): sum in parts and reduce fewer at once")
        self._adds = adds

    def merge(self, other):
        if other.dtype != self.dtype or other.shape != self.shape:
            raise ValueError("sums of another dtype or shape")
        other = other.copy()
        top = np.maximum(self.top, other.top)
        self._raise_top(top)
        other._raise_top(top)
        self._count(self._adds + other._adds)
        self.bins += other.bins
        return self

    def total(self):
        """A shape-() sum of every element of this one (the sum over elements, as exact as the rest:
        the bins of every element aligned to the largest top and added as integers)."""
        if not len(self.top):
            return ExactSum((), self.dtype)
        aligned = self.copy()
        aligned._raise_top(np.full(len(self.top), self.top.max(), np.int32))
        out = ExactSum._of(self.dtype, (), aligned.top[:1], aligned.bins.sum(axis=0))
        out._count(self._adds * len(self.top))
        return out

    @classmethod
    def from_arrays(cls, dtype, shape, top, bins):
        """A sum made of its integers (a peer's top and bins, received; taken, not copied)."""
        return cls._of(dtype, shape, top, bins)

    def copy(self):
        return ExactSum._of(self.dtype, self.shape, self.top.copy(), self.bins.copy(), self._adds)

    def allreduce(self, comm, algo="auto"):
        """Every rank of comm holds the sum of all ranks' partial sums (two integer allreduces:
        the largest top, then the bins aligned to it); exact whatever the communicator's algorithm."""
        if comm.size > 1:
            self._count(self._adds * comm.size)
            top = comm.allreduce(self.top.copy(), op="max", algo=algo)
            self._raise_top(top)
            got = comm.allreduce(self.bins, op="sum", algo=algo)      # in place where the algorithm can
            if got is not self.bins:
                self.bins[...] = got
        return self

    def reduce_scatter(self, comm, algo="auto"):
        """This rank's rows (axis 0, pympar's split: the first N % size ranks one more) of the sum
        of every rank's partial sums, as a new ExactSum; exact whatever the algorithm."""
        if not self.shape:
            raise ValueError("reduce_scatter splits axis 0: the sum has no axis")
        from .algorithms.p2p import bounds

        N, rest = self.shape[0], int(np.prod(self.shape[1:], dtype=np.int64))
        self._count(self._adds * comm.size)
        top = comm.allreduce(self.top.copy(), op="max") if comm.size > 1 else self.top.copy()
        self._raise_top(top)
        E = bounds(N, comm.size)
        lo, hi = E[comm.rank], E[comm.rank + 1]
        bins = self.bins.reshape(N, rest * self.K)
        got = comm.reduce_scatter(bins, op="sum", algo=algo) if comm.size > 1 else bins[lo:hi].copy()
        return ExactSum._of(self.dtype, (hi - lo,) + self.shape[1:], self.top[lo * rest:hi * rest].copy(), got,
                            self._adds)

    # --- reading -----------------------------------------------------------------------------
    def value(self):
        """The sum in the terms' dtype: the exact integers, normalised in a copy (a canonical form of
        their value; the bins themselves keep every carry where it was made, so a later rise of the
        window drops whole bins in any order), summed top bin first in float64 and rounded to the
        dtype; NaN where a term was not finite. The same integers give the same bits."""
        from .. import kernels

        out = np.empty(len(self.top), np.float64)
        kernels.exact_value(self.top, self.bins, out)
        return out.astype(self.dtype).reshape(self.shape)


def exact_sum(terms, dtype=None):
    """The reproducible sum of a sequence of same-shaped arrays."""
    terms = list(terms)
    acc = ExactSum(np.shape(terms[0]), dtype or np.asarray(terms[0]).dtype)
    for t in terms:
        acc.add(t)
    return acc.value()
