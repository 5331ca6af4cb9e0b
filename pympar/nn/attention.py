"""Causal multi-head self-attention (c_attn packs q, k, v like nanoGPT), forward and backward.

Gradient convention: see pympar/nn/parameter.py (param grads +=, activation grads =).
"""
from __future__ import annotations

import numpy as np

from .. import kernels
from ..kernels.blas import over_chunks
from ..backend import xp_of
from .layers import Linear
from .parameter import Module, matmul


class CausalSelfAttention(Module):
    def __init__(self, n_embd, n_head, *, name, seed=0, dtype=np.float32, bias=True, n_layer=1,
                 compute_dtype=None):
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
        self.n_head = n_head
        self.c_attn = Linear(n_embd, 3 * n_embd, name=f"{name}.c_attn", seed=seed, dtype=dtype,
                             bias=bias, compute_dtype=compute_dtype)
        self.c_proj = Linear(n_embd, n_embd, name=f"{name}.c_proj", seed=seed, dtype=dtype,
                             bias=bias, std=0.02 / (2 * n_layer) ** 0.5, compute_dtype=compute_dtype)

    def forward(self, x):                        # x (B, T, C) -> y (B, T, C)
        B, T, C = x.shape
        nh = self.n_head
        hs = C // nh
        xp = xp_of(x)
        qkv, _ = self.c_attn.forward(x)          # (B, T, 3C)
        # (B, T, 3, nh, hs) -> (3, B, nh, T, hs): views into qkv, no copies
        q, k, v = qkv.reshape(B, T, 3, nh, hs).transpose(2, 0, 3, 1, 4)
        # the 1/sqrt(hs) scale goes on q (N C numbers) rather than on att (B nh T T)
        qs = q * xp.asarray(1.0 / np.sqrt(hs), dtype=q.dtype)   # (B, nh, T, hs)
        ya = xp.empty((B, T, C), dtype=qkv.dtype)
        yh = ya.reshape(B, T, nh, hs).transpose(0, 2, 1, 3)       # (B, nh, T, hs) view of ya
        p = xp.empty((B, nh, T, T), dtype=qkv.dtype)

        def rows(b0, b1):                        # batch rows [b0, b1): writes p and ya only
            att = matmul(qs[b0:b1], k[b0:b1].transpose(0, 1, 3, 2))   # (b, nh, T, T)
            kernels.softmax_causal_forward(att, out=p[b0:b1])       # zeros above the diagonal
            matmul(p[b0:b1], v[b0:b1], out=yh[b0:b1])                # straight into ya

        _split(B, rows, xp)
        y, _ = self.c_proj.forward(ya)
        return y, (x, qs, k, v, p, ya)

    def backward(self, dy, ctx):                 # dy (B, T, C) -> dx (B, T, C)
        x, qs, k, v, p, ya = ctx
        B, T, C = x.shape
        nh = self.n_head
        hs = C // nh
        dya = self.c_proj.backward(dy, ya)       # (B, T, C)
        dyh = dya.reshape(B, T, nh, hs).transpose(0, 2, 1, 3)  # (B, nh, T, hs)
        xp = xp_of(dya)
        dqkv = xp.empty((B, T, 3, nh, hs), dtype=dya.dtype)  # (B, T, 3C) packed like c_attn
        dq, dk, dv = dqkv.transpose(2, 0, 3, 1, 4)           # (B, nh, T, hs) views of dqkv
        scale = xp.asarray(1.0 / np.sqrt(hs), dtype=dqkv.dtype)

        def rows(b0, b1):                        # batch rows [b0, b1): writes dqkv only
            pb, dyb = p[b0:b1], dyh[b0:b1]
            dp = matmul(dyb, v[b0:b1].transpose(0, 1, 3, 2))        # (b, nh, T, T)
            matmul(pb.transpose(0, 1, 3, 2), dyb, out=dv[b0:b1])
            datt = kernels.softmax_causal_backward(pb, dp)          # d(att), att = qs k^T
            matmul(datt.transpose(0, 1, 3, 2), qs[b0:b1], out=dk[b0:b1])
            dqb = dq[b0:b1]
            matmul(datt, k[b0:b1], out=dqb)                         # d(qs); dq = d(qs) * scale
            dqb *= scale

        _split(B, rows, xp)
        return self.c_attn.backward(dqkv.reshape(B, T, 3 * C), x)


def _split(B, rows, xp):
    """rows(b0, b1) over the batch: on NumPy side by side on the kernels' threads (the per-head
    GEMMs are too small for the BLAS's own threads to pay), else in one call."""
    if xp is np:
        over_chunks(B, rows, kernels.get_num_threads())
    else:
        rows(0, B)
