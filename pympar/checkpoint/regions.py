"""Rectangular regions of a full tensor: the slice a shard covers, and their intersections.

A region is a tuple of (start, stop) pairs, one per dimension of the full tensor. It is what
``Shard(full_shape, index)`` means once its slices are made explicit, and what the manifest
and the safetensors metadata record for every stored piece.
"""
from __future__ import annotations


def region_of(full_shape, index=None):
    """((start, stop), ...) of ``index`` (tuple of step-1 slices, may be shorter than the rank;
    None = the whole tensor) in a tensor of ``full_shape``."""
    full_shape = tuple(int(s) for s in full_shape)
    index = () if index is None else (index if isinstance(index, tuple) else (index,))
    if len(index) > len(full_shape):
        raise ValueError(f"index {index} has more entries than full_shape {full_shape} has dimensions")
    out = []
    for d, n in enumerate(full_shape):
        sl = index[d] if d < len(index) else slice(None)
        if isinstance(sl, (list, tuple)) and len(sl) == 2:  # already a (start, stop) pair
            sl = slice(int(sl[0]), int(sl[1]))
        if not isinstance(sl, slice):
            raise ValueError(f"index entry {sl!r} on dim {d}: expected a slice")
        start, stop, step = sl.indices(n)
        if step != 1:
            raise ValueError(f"slice {sl} on dim {d} has step {step}: shards are contiguous ranges (step 1)")
        out.append((start, max(start, stop)))
    return tuple(out)


def region_shape(region):
    return tuple(b - a for a, b in region)


def region_size(region):
    n = 1
    for a, b in region:
        n *= b - a
    return n


def intersect(r1, r2):
    """The overlap of two regions of the same tensor, or None when they do not overlap."""
    out = []
    for (a1, b1), (a2, b2) in zip(r1, r2):
        a, b = max(a1, a2), min(b1, b2)
        if a >= b:
            return None
        out.append((a, b))
    return tuple(out)


def local_index(region, within):
    """Slices selecting ``region`` (full-tensor coordinates) out of an array that holds ``within``."""
    return tuple(slice(a - w0, b - w0) for (a, b), (w0, _) in zip(region, within))


def to_json(region):
    return [[a, b] for a, b in region]


def from_json(obj):
    return tuple((int(a), int(b)) for a, b in obj)
