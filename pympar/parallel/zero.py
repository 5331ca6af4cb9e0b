"""ZeRO-1: the optimiser state sharded over the data-parallel group.

Each bucket of DataParallel (flat, padded to a multiple of dp) is reduce-scattered, so rank r
holds the mean gradient of the bucket's chunk [r*chunk, (r+1)*chunk). For that chunk only,
the rank keeps master weights (the parameters' dtype: float32, or float64 in float64 runs)
and the AdamW moments m, v; it updates them with the same elementwise kernel as AdamW, and
one allgather per bucket returns the updated parameters to every rank. Weight decay follows
pympar.optim.decays per parameter, so a chunk is updated piecewise, one piece per parameter
it overlaps. The padding at a bucket's end belongs to no parameter and is never updated.

Memory: plain DP keeps m, v for every parameter (2 N words per rank); ZeRO-1 keeps master,
m and v for N/dp of them (3 N/dp words), less than plain DP from dp = 2 on.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from .. import kernels
from ..backend import xp_of
from ..optim import clip_grad_norm


def optimizer_memory(buckets, dp: int, zero: bool) -> dict:
    """Optimiser bytes per rank: this layout's and plain DP's (master copies + m + v).

    Plain DP updates the parameters in place (no master copy) and keeps m, v for all N
    elements; ZeRO-1 keeps master, m, v for its padded chunk of every bucket."""
    plain = sum(2 * b.numel * b.dtype.itemsize for b in buckets)
    sharded = sum(3 * b.chunk * b.dtype.itemsize for b in buckets)
    this = sharded if zero else plain
    return dict(dp=int(dp), zero=bool(zero), params=int(sum(b.numel for b in buckets)),
                optimizer_bytes=int(this), plain_dp_bytes=int(plain), zero1_bytes=int(sharded),
                ratio_to_plain=this / plain if plain else 1.0)


class _Shard:
    """One bucket's chunk: master weights, moments and the (start, stop, decays) pieces."""

    def __init__(self, bucket, rank, decay_of):
        lo, hi = rank * bucket.chunk, (rank + 1) * bucket.chunk
        xp = xp_of(bucket.params[0].data)
        flat = xp.zeros(bucket.padded, dtype=bucket.params[0].data.dtype)   # (padded,)
        self.pieces = []
        for p, name, off, size in zip(bucket.params, bucket.names, bucket.offsets, bucket.sizes):
            flat[off:off + size] = p.data.reshape(-1)
            a, e = max(off, lo), min(off + size, hi)
            if a < e:
                self.pieces.append((a - lo, e - lo, decay_of(name, p.data)))
        self.master = flat[lo:hi].copy()                                     # (chunk,)
        self.m = xp.zeros_like(self.master)
        self.v = xp.zeros_like(self.master)
        self.bucket = bucket


class ZeroAdamW:
    """AdamW over this rank's chunks of DataParallel's buckets (after a reduce-scatter)."""

    def __init__(self, buckets, comm, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                 decay_fn=None):
        from ..optim import decays

        self.comm = comm
        self.lr, self.beta1, self.beta2, self.eps, self.weight_decay = lr, betas[0], betas[1], eps, weight_decay
        self.shards = [_Shard(b, comm.rank, decay_fn or decays) for b in buckets]
        self.step_count = 0

    @classmethod
    def from_optimizer(cls, opt, buckets, comm):
        """Take lr, betas, eps, weight decay and per-name decay from a pympar.optim.AdamW."""
        decay = getattr(opt, "decay", None)
        fn = (lambda name, data: decay[name]) if decay else None
        return cls(buckets, comm, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
                   weight_decay=opt.weight_decay, decay_fn=fn)

    def step(self, lr=None, clip=0.0, allreduce_sq=None) -> float:
        """Clip by the global norm, update the chunks, allgather parameters; return the norm.

        Needs every bucket's ``result`` (its mean gradient chunk) from DataParallel.finish()."""
        grads = []
        for s in self.shards:
            if s.bucket.result is None:
                raise RuntimeError(f"bucket {s.bucket.index} has no reduced gradient: call DataParallel.finish() before step()")
            grads.append(s.bucket.result)                                   # (chunk,)
        norm = clip_grad_norm([SimpleNamespace(grad=g) for g in grads], clip, self._sum_sq(allreduce_sq))
        lr = self.lr if lr is None else lr
        self.step_count += 1
        for s, g in zip(self.shards, grads):
            for a, e, dec in s.pieces:
                kernels.adamw_step(s.master[a:e], g[a:e], s.m[a:e], s.v[a:e], lr=lr,
                                   beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                                   weight_decay=self.weight_decay if dec else 0.0,
                                   step=self.step_count)
        self._allgather_params()
        return norm

    def _sum_sq(self, allreduce_sq):
        """A sum of squares over dp (the chunks partition the gradient), then over the other groups."""
        def total(sq):
            if self.comm.size > 1:
                sq = float(np.asarray(self.comm.allreduce(np.array([sq], dtype=np.float64))).reshape(-1)[0])
            return sq if allreduce_sq is None else float(allreduce_sq(sq))
        return total

    def _allgather_params(self):
        for s in self.shards:
            b = s.bucket
            full = s.master if self.comm.size == 1 else xp_of(s.master).asarray(self.comm.allgather(s.master)).reshape(-1)
            for p, off, size in zip(b.params, b.offsets, b.sizes):           # full (padded,)
                p.data[...] = full[off:off + size].reshape(p.data.shape)

    def export_to(self, opt):
        """Collective over dp: write the full m, v (allgathered) and the step into a pympar
        AdamW ``opt``, so checkpoints see the ordinary, layout-free optimiser state."""
        for s in self.shards:
            b = s.bucket
            for mine, full_of in ((s.m, opt.m), (s.v, opt.v)):
                full = mine if self.comm.size == 1 else xp_of(mine).asarray(self.comm.allgather(mine)).reshape(-1)
                for name, off, size in zip(b.names, b.offsets, b.sizes):   # full (padded,)
                    full_of[name][...] = full[off:off + size].reshape(full_of[name].shape)
        opt.step_count = self.step_count

    def import_from(self, opt):
        """Take this rank's chunks of m, v, the step from ``opt`` and master weights from the
        parameters (after a checkpoint restore into the model and the full AdamW)."""
        r = self.comm.rank
        for s in self.shards:
            b = s.bucket
            lo = r * b.chunk
            flat = {k: xp_of(s.master).zeros(b.padded, dtype=s.master.dtype) for k in ("master", "m", "v")}
            for p, name, off, size in zip(b.params, b.names, b.offsets, b.sizes):
                flat["master"][off:off + size] = p.data.reshape(-1)
                flat["m"][off:off + size] = opt.m[name].reshape(-1)
                flat["v"][off:off + size] = opt.v[name].reshape(-1)
            for k, a in flat.items():
                getattr(s, k)[...] = a[lo:lo + b.chunk]
        self.step_count = int(opt.step_count)

    def state_dict(self):
        """This rank's chunks: step, and per bucket index the (master, m, v) arrays."""
        return dict(step=self.step_count,
                    shards={s.bucket.index: dict(master=s.master.copy(), m=s.m.copy(), v=s.v.copy())
                            for s in self.shards})

    def load_state_dict(self, d):
        self.step_count = int(d["step"])
        for s in self.shards:
            got = d["shards"][s.bucket.index]
            for k in ("master", "m", "v"):
                if got[k].shape != getattr(s, k).shape:
                    raise ValueError(f"ZeRO shard {s.bucket.index} {k}: shape {got[k].shape}, expected {getattr(s, k).shape} (same dp and bucket_mb?)")
                dst = getattr(s, k)
                dst[...] = xp_of(dst).asarray(got[k])    # host arrays into device chunks
