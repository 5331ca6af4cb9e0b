"""Causal multi-head self-attention (c_attn packs q, k, v like nanoGPT), forward and backward.

The attention math between the two projections is nn.attention_core (shared with the
tensor-parallel attention). Gradient convention: see pympar/nn/parameter.py (param grads +=,
activation grads =).
"""
from __future__ import annotations

import numpy as np

from .attention_core import AttentionModule, CausalAttentionCore
from .layers import Linear


class CausalSelfAttention(AttentionModule):
    def __init__(self, n_embd, n_head, *, name, seed=0, dtype=np.float32, bias=True, n_layer=1,
                 compute_dtype=None):
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
        self.n_head = n_head
        self.c_attn = Linear(n_embd, 3 * n_embd, name=f"{name}.c_attn", seed=seed, dtype=dtype,
                             bias=bias, compute_dtype=compute_dtype)
        self.c_proj = Linear(n_embd, n_embd, name=f"{name}.c_proj", seed=seed, dtype=dtype,
                             bias=bias, std=0.02 / (2 * n_layer) ** 0.5, compute_dtype=compute_dtype)
        self.core = CausalAttentionCore()

    def forward(self, x):                        # x (B, T, C) -> y (B, T, C)
        B, T, C = x.shape
        nh = self.n_head
        qkv, _ = self.c_attn.forward(x)          # (B, T, 3C)
        ya, core = self.core.forward(qkv.reshape(B, T, 3, nh, C // nh))   # (B, T, C)
        y, _ = self.c_proj.forward(ya)
        return y, (x, core, ya)

    def backward(self, dy, ctx):                 # dy (B, T, C) -> dx (B, T, C)
        x, core, ya = ctx
        del ctx                                  # each piece is let go once used: qkv (3C), the
        B, T, C = x.shape                        # output and its gradient are not held beside dqkv
        dya = self.c_proj.backward(dy, ya)       # (B, T, C)
        del ya
        dqkv = self.core.backward(dya, core, consume=True)     # (B, T, 3, nh, hs)
        del dya, core                            # (CPython >= 3.11 moves a call's arguments into
                                                 # the callee's frame; 3.10's caller holds them to return)
        return self.c_attn.backward(dqkv.reshape(B, T, 3 * C), x)
