"""Which part of a full tensor a stored piece or a wanted shard covers, and their overlaps.

Everything is a ``Shard(full_shape, index)`` (pympar/parallel/shard.py): per dimension a block
or a union of blocks. ``Shard.pieces()`` splits one into rectangles (full region, local region)
with regions as ((start, stop), ...) per dimension; reading and resharding work on those.
"""
from __future__ import annotations

from ..parallel.shard import Shard


def as_shard(spec, shape=None) -> Shard:
    """A Shard from a Shard-like object, a (full_shape, index) pair, or None (the whole ``shape``)."""
    if spec is None:
        if shape is None:
            raise ValueError("a replicated tensor (shard None) needs its shape")
        return Shard(tuple(shape), ())
    if hasattr(spec, "full_shape"):
        return spec if isinstance(spec, Shard) else Shard(tuple(spec.full_shape), tuple(spec.index))
    full_shape, index = spec
    return Shard(tuple(full_shape), () if index is None else index)


def index_json(shard: Shard):
    """The blocks of a shard as JSON: per dimension [[start, stop], ...]."""
    return shard.to_json()["index"]


def shard_from_json(full_shape, index):
    return Shard.from_json({"full_shape": list(full_shape), "index": index})


def intersect(r1, r2):
    """The overlap of two rectangular regions of the same tensor, or None."""
    out = []
    for (a1, b1), (a2, b2) in zip(r1, r2):
        a, b = max(a1, a2), min(b1, b2)
        if a >= b:
            return None
        out.append((a, b))
    return tuple(out)


def sub_index(part, full_rect, local_rect):
    """Slices selecting full-tensor region ``part`` from a local array whose ``local_rect``
    holds the full-tensor rectangle ``full_rect`` (part lies inside full_rect)."""
    return tuple(slice(l0 + a - f0, l0 + b - f0)
                 for (a, b), (f0, _), (l0, _) in zip(part, full_rect, local_rect))
