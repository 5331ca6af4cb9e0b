"""Causal multi-head self-attention (c_attn packs q, k, v like nanoGPT), forward and backward.

Gradient convention: see pympar/nn/parameter.py (param grads +=, activation grads =).
"""
from __future__ import annotations

import numpy as np

from .. import kernels
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
        qkv, _ = self.c_attn.forward(x)          # (B, T, 3C)
        # (B, T, 3, nh, hs) -> (3, B, nh, T, hs)
        q, k, v = qkv.reshape(B, T, 3, nh, hs).transpose(2, 0, 3, 1, 4)
        scale = xp_of(x).asarray(1.0 / np.sqrt(hs), dtype=x.dtype)
        att = matmul(q, k.transpose(0, 1, 3, 2))  # (B, nh, T, T)
        att *= scale
        p = kernels.softmax_causal_forward(att)  # (B, nh, T, T), zeros above the diagonal
        yh = matmul(p, v)                        # (B, nh, T, hs)
        ya = yh.transpose(0, 2, 1, 3).reshape(B, T, C)
        y, _ = self.c_proj.forward(ya)
        return y, (x, q, k, v, p, ya)

    def backward(self, dy, ctx):                 # dy (B, T, C) -> dx (B, T, C)
        x, q, k, v, p, ya = ctx
        B, T, C = x.shape
        nh = self.n_head
        hs = C // nh
        dya = self.c_proj.backward(dy, ya)       # (B, T, C)
        dyh = dya.reshape(B, T, nh, hs).transpose(0, 2, 1, 3)  # (B, nh, T, hs)
        dp = matmul(dyh, v.transpose(0, 1, 3, 2))  # (B, nh, T, T)
        dv = matmul(p.transpose(0, 1, 3, 2), dyh)  # (B, nh, T, hs)
        datt = kernels.softmax_causal_backward(p, dp)
        xp = xp_of(datt)
        datt *= xp.asarray(1.0 / np.sqrt(hs), dtype=datt.dtype)
        dq = matmul(datt, k)                     # (B, nh, T, hs)
        dk = matmul(datt.transpose(0, 1, 3, 2), q)
        dqkv = xp.empty((B, T, 3, nh, hs), dtype=dq.dtype)  # (B, T, 3C) packed like c_attn
        dqkv[:, :, 0] = dq.transpose(0, 2, 1, 3)
        dqkv[:, :, 1] = dk.transpose(0, 2, 1, 3)
        dqkv[:, :, 2] = dv.transpose(0, 2, 1, 3)
        return self.c_attn.backward(dqkv.reshape(B, T, 3 * C), x)
