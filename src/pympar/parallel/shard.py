"""Shard: which part of a full parameter tensor a rank holds, and helpers to cut it.

``Shard(full_shape, index)``: ``index`` has one entry per dimension of the full tensor (missing
trailing entries mean the whole dimension). An entry is either a step-1 ``slice`` or a tuple of
step-1 slices: a UNION of blocks along that dimension, concatenated in order in the local array.
The union form exists for tensor-parallel attention: c_attn's weight (3C, C) stacks [q; k; v],
and a tp rank holds the rows of its heads in each of q, k and v:
    index = ((slice(r*w, (r+1)*w), slice(C + r*w, C + (r+1)*w), slice(2C + r*w, 2C + (r+1)*w)),)
with w = C / tp. ``pieces()`` splits any shard into rectangular (full region, local region)
pairs, so code that only understands contiguous regions (checkpoints, resharding) can use it.

A sharded Parameter is a Parameter with a ``.shard``, whose name is the GLOBAL nanoGPT name and
whose data is exactly ``init_param(seed, name, full_shape)[index]`` (made for the slice alone).
``shard_of(p)`` is None for a Parameter holding the full tensor.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from ..nn.parameter import make_param


def _norm_entry(entry, n, dim):
    """A slice or tuple of slices -> tuple of (start, stop) pairs, step 1, inside [0, n]."""
    blocks = entry if isinstance(entry, tuple) else (entry,)
    out = []
    for sl in blocks:
        if not isinstance(sl, slice):
            raise ValueError(f"Shard index entry {sl!r} on dim {dim}: expected a slice or a tuple of slices")
        start, stop, step = sl.indices(n)
        if step != 1:
            raise ValueError(f"slice {sl} on dim {dim} has step {step}: shard blocks are step-1 ranges")
        out.append((start, max(start, stop)))
    return tuple(out)


@dataclass(frozen=True)
class Shard:
    full_shape: tuple
    index: tuple

    def __post_init__(self):
        fs = tuple(int(s) for s in self.full_shape)
        ix = self.index if isinstance(self.index, tuple) else (self.index,)
        if len(ix) > len(fs):
            raise ValueError(f"Shard index {ix} has more entries than full_shape {fs} has dimensions")
        ix = ix + (slice(None),) * (len(fs) - len(ix))
        for d, (e, n) in enumerate(zip(ix, fs)):
            _norm_entry(e, n, d)          # validates
        object.__setattr__(self, "full_shape", fs)
        object.__setattr__(self, "index", ix)

    # --- geometry ------------------------------------------------------------------------------
    def blocks(self):
        """Per dimension, the tuple of (start, stop) blocks (one block when contiguous)."""
        return tuple(_norm_entry(e, n, d) for d, (e, n) in enumerate(zip(self.index, self.full_shape)))

    @property
    def local_shape(self):
        return tuple(sum(b - a for a, b in bl) for bl in self.blocks())

    @property
    def is_contiguous(self):
        return all(len(bl) == 1 for bl in self.blocks())

    def pieces(self):
        """[(full_region, local_region)]: rectangular pieces, each a tuple of (start, stop) per dim,
        covering the shard; ``local[local_region] == full[full_region]``."""
        per_dim = []
        for bl in self.blocks():
            off, pairs = 0, []
            for a, b in bl:
                pairs.append(((a, b), (off, off + b - a)))
                off += b - a
            per_dim.append(pairs)
        return [(tuple(p[0] for p in combo), tuple(p[1] for p in combo))
                for combo in itertools.product(*per_dim)]

    def np_index(self):
        """An index for NumPy: ``full[shard.np_index()]`` is the local array (a view when contiguous);
        ``full[shard.np_index()] = local`` writes it back."""
        blocks = self.blocks()
        if all(len(bl) == 1 for bl in blocks):
            return tuple(slice(bl[0][0], bl[0][1]) for bl in blocks)
        return np.ix_(*[np.concatenate([np.arange(a, b) for a, b in bl]) if bl else np.arange(0)
                        for bl in blocks])

    def take(self, full):
        """The local part of a full array (a copy)."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"full array shape {tuple(full.shape)} != Shard.full_shape {self.full_shape}")
        return np.array(full[self.np_index()])

    def put(self, full, local):
        """Write ``local`` into its place in ``full`` (in place)."""
        if tuple(local.shape) != self.local_shape:
            raise ValueError(f"local array shape {tuple(local.shape)} != Shard.local_shape {self.local_shape}")
        full[self.np_index()] = local
        return full

    def to_json(self):
        return dict(full_shape=list(self.full_shape),
                    index=[[list(b) for b in bl] for bl in self.blocks()])

    @classmethod
    def from_json(cls, obj):
        ix = tuple(tuple(slice(a, b) for a, b in bl) if len(bl) != 1 else slice(*bl[0])
                   for bl in obj["index"])
        return cls(tuple(obj["full_shape"]), ix)


def shard_of(p):
    """The Shard of a parameter, or None when it holds the full tensor."""
    return getattr(p, "shard", None)


# --- partitions of one dimension -----------------------------------------------------------------
def even_slice(n: int, parts: int, rank: int, what: str = "dimension") -> slice:
    """The rank-th of ``parts`` equal contiguous parts of range(n); n must be divisible by parts."""
    if n % parts:
        raise ValueError(f"{what}={n} is not divisible by tp={parts}")
    w = n // parts
    return slice(rank * w, (rank + 1) * w)


def padded_partition(n: int, parts: int):
    """Padded length and part size: n rounded up to a multiple of parts -> (n_padded, part)."""
    part = -(-n // parts)
    return part * parts, part


def padded_slice(n: int, parts: int, rank: int) -> slice:
    """The real (unpadded) rows of the rank-th part when n is padded to a multiple of parts.

    Parts have ``ceil(n/parts)`` rows; the last parts may hold fewer real rows, or none."""
    _, part = padded_partition(n, parts)
    lo = min(rank * part, n)
    return slice(lo, min(lo + part, n))


def stacked_slices(n_stack: int, width: int, sl: slice) -> tuple:
    """The block ``sl`` of each of ``n_stack`` stacked matrices of ``width`` rows: for c_attn's
    [q; k; v] (n_stack=3, width=C) and a head range, the rows of those heads in q, k and v."""
    return tuple(slice(i * width + sl.start, i * width + sl.stop) for i in range(n_stack))


def make_sharded(seed: int, name: str, full_shape, index, dtype=np.float32, std: float = 0.02):
    """A Parameter holding ``index`` of init_param(seed, name, full_shape): identical numbers in
    every layout, produced for the slice alone (pympar.nn.init) when first used."""
    return make_param(seed, name, full_shape, dtype, std, shard=Shard(tuple(full_shape), index))


def make_replicated(seed: int, name: str, shape, dtype=np.float32, std: float = 0.02):
    return make_param(seed, name, shape, dtype, std)
