"""Initial values addressed by element: any slice of a parameter without the full tensor.

Every initial weight is a function of (seed, name, full shape) alone (docs/design.md, Determinism).
A rank that holds a slice (a tensor-parallel shard, a stage, an expert, a ZeRO-3 row chunk)
produces just that slice: element ``e`` (its row-major flat index in the FULL tensor) is

    key     = 64 bits of SeedSequence([seed, crc32(name), *full_shape])
    u1, u2  = two 53-bit uniforms from splitmix64(key + (2e+1) * gamma), splitmix64(key + (2e+2) * gamma)
    value   = std * sqrt(-2 ln(1 - u1)) * cos(2 pi u2)          (Box-Muller, computed in float64)

a counter-based generator: no state is carried from one element to the next, so a block of
elements costs what its size costs, wherever it sits. Blocks are produced in row groups of
at most ``BLOCK`` elements, the only transient memory.
"""
from __future__ import annotations

import zlib

import numpy as np

BLOCK = 1 << 14                      # elements per generated block (a few 128 KiB float64 temporaries)
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = (np.uint64(s) for s in (30, 27, 31, 11))
_TWO_M53 = 2.0 ** -53


def stream_key(seed: int, name: str, full_shape) -> np.uint64:
    """The 64-bit key of one parameter's stream."""
    ss = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, zlib.crc32(name.encode()), *map(int, full_shape)])
    return ss.generate_state(1, np.uint64)[0]


def _splitmix(z):
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic), in place."""
    z ^= z >> _S30
    z *= _M1
    z ^= z >> _S27
    z *= _M2
    z ^= z >> _S31
    return z


def normal_at(key: np.uint64, flat) -> np.ndarray:
    """Standard normals (float64) of the elements with flat indices ``flat`` (uint64 array)."""
    c = flat.astype(np.uint64) * np.uint64(2)
    with np.errstate(over="ignore"):
        a = _splitmix((c + np.uint64(1)) * _GAMMA + key)
        b = _splitmix((c + np.uint64(2)) * _GAMMA + key)
    u1 = (a >> _S11).astype(np.float64) * _TWO_M53          # [0, 1)
    u2 = (b >> _S11).astype(np.float64) * _TWO_M53
    return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)


def _region_into(out, key, full_shape, region, std):
    """Write the normals of the rectangular ``region`` ((start, stop) per dim) of the full tensor into
    ``out`` (the region's shape), a group of leading rows at a time."""
    strides = [1] * len(full_shape)
    for d in range(len(full_shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * int(full_shape[d + 1])
    if not full_shape:                                  # a scalar
        out[...] = normal_at(key, np.zeros(1, np.uint64))[0] * std
        return
    inner = [np.arange(a, b, dtype=np.uint64) * np.uint64(s) for (a, b), s in zip(region[1:], strides[1:])]
    offs = np.zeros(1, np.uint64)
    for ax in inner:                                    # flat offsets of one row of the region
        offs = (offs[:, None] + ax[None, :]).reshape(-1)
    per_row = max(offs.size, 1)
    (r0, r1), step = region[0], max(1, BLOCK // per_row)
    flat_out = out.reshape(r1 - r0, per_row) if out.size else out
    for lo in range(r0, r1, step):
        hi = min(lo + step, r1)
        rows = np.arange(lo, hi, dtype=np.uint64) * np.uint64(strides[0])
        vals = normal_at(key, (rows[:, None] + offs[None, :]).reshape(-1))
        vals *= std
        flat_out[lo - r0:hi - r0] = vals.reshape(hi - lo, per_row)


def normal_slice(seed: int, name: str, full_shape, pieces, local_shape, dtype, std: float):
    """The local array of a slice of parameter ``name``'s normal(0, std) initial tensor.

    pieces: [(full_region, local_region)] rectangles covering the slice (Shard.pieces())."""
    full_shape = tuple(int(s) for s in full_shape)
    key = stream_key(seed, name, full_shape)
    out = np.empty(local_shape, dtype=dtype)
    for full_region, local_region in pieces:
        dst = out[tuple(slice(a, b) for a, b in local_region)]
        if dst.size:
            _region_into(dst, key, full_shape, full_region, std)
    return out
