"""Gradient compression for the data-parallel sync (off by default).

A compressor turns one bucket's local gradient into the MEAN over the data-parallel group,
exchanging fewer bytes than a dense allreduce, and says how many bytes it sent:

* ``CastCompressor("float16" | "bfloat16")``: the bucket is cast to the low precision, split
  into dp chunks and exchanged with one alltoall; each rank sums the dp received chunks in
  float32 (float64 for float64 grads) in rank order, divides by dp, and the mean chunk is
  allgathered in the low precision again. Half the bytes of a dense ring allreduce; the
  received values are accumulated in full precision, the mean is rounded once.
* ``TopKCompressor(ratio)``: error feedback (Seide et al. 2014; Lin et al. 2018): the
  residual left unsent is kept locally and added to the next step's gradient; each rank
  sends its k = ceil(ratio * n) largest-magnitude entries as (int32 index, value) pairs with
  one allgather, every rank scatters the dp sparse vectors into a dense sum in rank order and
  divides by dp, so all ranks hold the same mean.

Byte counts per rank per call (B = bucket bytes, n = dp): ``payload`` is what the rank hands
to the collectives; ``wire`` is what it sends under ring/pairwise algorithms (dense ring
allreduce 2(n-1)/n B; alltoall (n-1)/n of its buffer; allgather (n-1) times its part).
"""
from __future__ import annotations

import math

import numpy as np

from .. import kernels
from ..backend import dtype as resolve_dtype, dtype_name, xp_of


def _acc_dtype(dt):
    return np.float64 if np.dtype(dt) == np.float64 else np.float32


def dense_allreduce_bytes(nbytes: int, n: int) -> dict:
    """Bytes of an uncompressed ring allreduce of nbytes over n ranks (the baseline)."""
    return dict(payload=nbytes, wire=(2 * (n - 1) * nbytes) // n if n > 1 else 0)


class CastCompressor:
    """Low-precision exchange with full-precision accumulation of what is received."""

    def __init__(self, dtype="float16"):
        self.dtype = np.dtype(resolve_dtype(dtype))
        if self.dtype.itemsize != 2:
            raise ValueError(f"cast compression to {dtype!r}: expected 'float16' or 'bfloat16'")
        self.name = f"cast-{dtype_name(self.dtype)}"

    def reduce_mean(self, comm, key, buf, shard_only: bool):
        """buf (P,) local grads, P divisible by comm.size -> (mean (P,) or own chunk (P/n,), bytes)."""
        n = comm.size
        P = buf.shape[0]
        if P % n:
            raise ValueError(f"bucket of {P} elements is not padded to a multiple of dp={n}")
        low = kernels.cast(buf, self.dtype)                     # (P,) = n chunks of P/n
        got = comm.alltoall(low).reshape(-1)                    # (P,): chunk r of rank j at j
        acc = _acc_dtype(buf.dtype)
        chunks = got.reshape(n, P // n)
        total = chunks[0].astype(acc)
        for j in range(1, n):                                   # rank order: same on every rank
            total += chunks[j].astype(acc)
        total *= acc(1.0 / n)
        sent = (n - 1) * low.nbytes // n
        if shard_only:
            return total.astype(buf.dtype, copy=False), dict(payload=low.nbytes, wire=sent, collectives=1)
        full = comm.allgather(kernels.cast(total, self.dtype)).reshape(-1)   # (P,) low precision
        sent += (n - 1) * (low.nbytes // n)
        return full.astype(buf.dtype), dict(payload=low.nbytes + low.nbytes // n, wire=sent, collectives=2)


class TopKCompressor:
    """Top-k sparsification with error feedback; ``ratio`` = fraction of entries sent."""

    def __init__(self, ratio=0.01):
        ratio = float(ratio)
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"top-k ratio {ratio} must be in (0, 1]")
        self.ratio = ratio
        self.name = f"topk-{ratio:g}"
        self.residual = {}                                      # key -> (P,) unsent remainder

    def k_of(self, numel: int) -> int:
        return max(1, min(numel, math.ceil(self.ratio * numel)))

    def reduce_mean(self, comm, key, buf, shard_only: bool, numel=None):
        """buf (P,) local grads (entries >= numel are padding) -> (mean (P,) or chunk, bytes)."""
        xp = xp_of(buf)
        n = comm.size
        P = buf.shape[0]
        numel = P if numel is None else numel
        res = self.residual.get(key)
        if res is None:
            res = self.residual[key] = xp.zeros_like(buf)
        res += buf                                              # corrected gradient g + e
        k = self.k_of(numel)
        mag = xp.abs(res[:numel])
        idx = xp.argpartition(-mag, k - 1)[:k] if k < numel else xp.arange(numel)
        idx = xp.sort(idx).astype(np.int32)                     # (k,)
        vals = res[idx].copy()                                  # (k,)
        res[idx] = 0                                            # error feedback: keep the rest
        all_idx = comm.allgather(idx).reshape(n, k)             # (n, k)
        all_vals = comm.allgather(vals).reshape(n, k)           # (n, k)
        dense = xp.zeros(P, dtype=_acc_dtype(buf.dtype))
        for j in range(n):                                      # indices unique within a rank
            dense[all_idx[j]] += all_vals[j]
        dense *= 1.0 / n
        out = dense.astype(buf.dtype, copy=False)
        if shard_only:
            c = P // n
            out = out[comm.rank * c:(comm.rank + 1) * c]
        payload = idx.nbytes + vals.nbytes
        return out, dict(payload=payload, wire=(n - 1) * payload, collectives=2)


def make_compressor(spec):
    """None/'none' -> None; 'fp16'|'float16'|'bf16'|'bfloat16' -> CastCompressor; 'topk:0.01' -> TopKCompressor."""
    if spec is None or spec is False or spec == "none" or spec == "":
        return None
    if not isinstance(spec, str):
        return spec                                             # already a compressor object
    s = spec.lower()
    if s in ("fp16", "float16"):
        return CastCompressor("float16")
    if s in ("bf16", "bfloat16"):
        return CastCompressor("bfloat16")
    if s.startswith("topk"):
        _, _, r = s.partition(":")
        return TopKCompressor(float(r) if r else 0.01)
    raise ValueError(f"unknown gradient compression {spec!r}: expected none, fp16, bf16 or topk:<ratio>")
