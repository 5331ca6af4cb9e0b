"""The causal attention core: the math between the qkv projection and the output projection.

One implementation for nn.CausalSelfAttention (nh = n_head) and parallel.tp.TPCausalSelfAttention
(nh = the tp rank's local heads): heads are independent, so a rank running its heads through
this core computes exactly the numbers the single process computes for them.

  forward:  qkv (B, T, 3, nh, hs), packed as c_attn writes it -> ya (B, T, nh*hs), as c_proj reads it
  backward: dya (B, T, nh*hs) -> dqkv (B, T, 3, nh, hs), packed as c_attn's backward reads it

Two implementations of the same math:
- tiled (the default for float32/float64/bfloat16 NumPy arrays when the C++ kernels are built):
  kernels.attention_forward/backward, flash-attention style. The forward keeps the row
  log-sum-exp beside qkv and the output; the backward recomputes the probabilities tile by tile.
  No (T, T) array exists, so attention's memory is linear in T; recomputation "selective" has
  nothing left to drop.
- on CuPy, ``impl = "tiled"`` runs the CUDA twin (csrc/cuda/attention.cu, head size <= 128);
  "auto" keeps the materialized path there until the twin has been run on a GPU.
- materialized (CuPy arrays, float16, no native build, or ``impl = "materialized"``):
  the (B, nh, T, T) probabilities per batch row, GEMMs through nn.products.matmul (float32
  accumulation for the half types) and the softmax kernels. It is the reference the tiled
  kernel is tested against (tests/test_attention_kernel.py).
"""
from __future__ import annotations

import numpy as np

from .. import kernels
from ..backend import dtype as backend_dtype
from ..backend import xp_of
from ..kernels.blas import over_chunks
from .module import Module
from .products import matmul


IMPLS = ("auto", "tiled", "materialized")


def tiled_available(dtype, xp=np) -> bool:
    """True when attention on arrays of this dtype and array module runs the tiled kernel (bfloat16:
    widened to float32 for it, kernels.native)."""
    dt = backend_dtype(dtype)                    # (a name: "bfloat16" loads ml_dtypes when first asked)
    return xp is np and kernels.native_available() and (dt in (np.float32, np.float64) or dt.name == "bfloat16")


class CausalAttentionCore(Module):
    """softmax(q k^T / sqrt(hs), causal) v per head; no parameters.

    impl: "auto" (tiled where tiled_available, else materialized), "tiled" (an error where it is
    not available) or "materialized". keep_probs=False (selective recomputation, materialized
    path): the ctx holds q, k, v only and backward computes the probabilities again, batch row
    by batch row (bitwise the same numbers)."""

    keep_probs = True
    impl = "auto"

    def _tiled(self, qkv) -> bool:
        if self.impl == "materialized":
            return False
        if self.impl not in IMPLS:
            raise ValueError(f"attention impl={self.impl!r}: expected one of {IMPLS}")
        xp = xp_of(qkv)
        if xp is not np:                         # CuPy: the CUDA twin on request only
            ok = (self.impl == "tiled" and kernels.cuda_available() and qkv.shape[-1] <= 128
                  and np.dtype(qkv.dtype) != np.float64)
        else:
            ok = tiled_available(qkv.dtype, xp) and not kernels._forced_reference()
        if self.impl == "tiled" and not ok:
            raise ValueError(f"attention impl='tiled' needs float32/float64/bfloat16 NumPy arrays and the C++ kernels (or, on "
                             f"CuPy, the CUDA kernels and a head size <= 128); got {qkv.dtype} {qkv.shape} on "
                             f"{kernels.backend(qkv)}: use impl='auto' or 'materialized'")
        return ok

    def forward(self, qkv):                      # qkv (B, T, 3, nh, hs) -> ya (B, T, nh*hs), ctx
        B, T, three, nh, hs = qkv.shape
        if three != 3:
            raise ValueError(f"qkv has shape {qkv.shape}: expected (B, T, 3, n_head, head_size)")
        if self._tiled(qkv):
            ya, lse = kernels.attention_forward(qkv, 1.0 / np.sqrt(hs))
            return ya, ("tiled", qkv, ya, lse)
        xp = xp_of(qkv)
        # (B, T, 3, nh, hs) -> (3, B, nh, T, hs): views into qkv, no copies
        q, k, v = qkv.transpose(2, 0, 3, 1, 4)
        # the 1/sqrt(hs) scale goes on q (N C numbers) rather than on att (B nh T T)
        qs = q * xp.asarray(1.0 / np.sqrt(hs), dtype=q.dtype)   # (B, nh, T, hs)
        ya = xp.empty((B, T, nh * hs), dtype=qkv.dtype)
        yh = ya.reshape(B, T, nh, hs).transpose(0, 2, 1, 3)       # (B, nh, T, hs) view of ya
        p = xp.empty((B, nh, T, T), dtype=qkv.dtype)

        def rows(b0, b1):                        # batch rows [b0, b1): writes p and ya only
            att = matmul(qs[b0:b1], k[b0:b1].transpose(0, 1, 3, 2))   # (b, nh, T, T)
            kernels.softmax_causal_forward(att, out=p[b0:b1])       # zeros above the diagonal
            matmul(p[b0:b1], v[b0:b1], out=yh[b0:b1])                # straight into ya

        _split(B, rows, xp)
        return ya, (qs, k, v, p if self.keep_probs else None)

    def backward(self, dya, ctx, consume=False):  # dya (B, T, nh*hs) -> dqkv (B, T, 3, nh, hs)
        """consume=True: the caller will not use ctx again (its qkv is the module's own), so the
        tiled kernel may write dqkv over qkv: 3C per token less at the backward's peak."""
        if isinstance(ctx[0], str):              # ("tiled", qkv, ya, lse)
            _, qkv, ya, lse = ctx
            return kernels.attention_backward(qkv, ya, lse, dya, 1.0 / np.sqrt(qkv.shape[-1]), overwrite=consume)
        qs, k, v, p = ctx
        B, nh, T, hs = qs.shape
        dyh = dya.reshape(B, T, nh, hs).transpose(0, 2, 1, 3)  # (B, nh, T, hs)
        xp = xp_of(dya)
        dqkv = xp.empty((B, T, 3, nh, hs), dtype=dya.dtype)
        dq, dk, dv = dqkv.transpose(2, 0, 3, 1, 4)           # (B, nh, T, hs) views of dqkv
        scale = xp.asarray(1.0 / np.sqrt(hs), dtype=dqkv.dtype)

        def rows(b0, b1):                        # batch rows [b0, b1): writes dqkv only
            dyb = dyh[b0:b1]
            if p is None:                        # recompute this row range's probabilities
                att = matmul(qs[b0:b1], k[b0:b1].transpose(0, 1, 3, 2))   # (b, nh, T, T)
                pb = kernels.softmax_causal_forward(att)
            else:
                pb = p[b0:b1]
            dp = matmul(dyb, v[b0:b1].transpose(0, 1, 3, 2))        # (b, nh, T, T)
            matmul(pb.transpose(0, 1, 3, 2), dyb, out=dv[b0:b1])
            datt = kernels.softmax_causal_backward(pb, dp)          # d(att), att = qs k^T
            matmul(datt.transpose(0, 1, 3, 2), qs[b0:b1], out=dk[b0:b1])
            dqb = dq[b0:b1]
            matmul(datt, k[b0:b1], out=dqb)                         # d(qs); dq = d(qs) * scale
            dqb *= scale

        _split(B, rows, xp)
        return dqkv


def _split(B, rows, xp):
    """rows(b0, b1) over the batch: on NumPy side by side on the kernels' threads (the per-head
    GEMMs are too small for the BLAS's own threads to pay), else in one call."""
    if xp is np:
        over_chunks(B, rows, kernels.get_num_threads())
    else:
        rows(0, B)


class AttentionModule(Module):
    """A module whose attention math between its projections is ``self.core``, a
    CausalAttentionCore (nn.attention.CausalSelfAttention, parallel.tp.TPCausalSelfAttention):
    context parallelism puts its ring or Ulysses core there (parallel.cp.install_context_parallel)."""
    core: CausalAttentionCore

