"""Tensor-parallel causal self-attention: c_attn column-parallel BY HEADS, c_proj row-parallel.

A tp rank owns heads [r*H/tp, (r+1)*H/tp). c_attn's weight (3C, C) stacks [q; k; v], so the
rank's rows are that head range inside each of q, k and v: a non-contiguous Shard (three
blocks along dim 0, see shard.py). The local projection then packs (B, T, 3, H/tp, hs) exactly
like the full one packs (B, T, 3, H, hs), and the attention math between the projections is
nn.attention_core's, the single process's own. Attention itself needs no communication; c_proj's
allreduce (or reduce-scatter with sequence parallelism) is the one collective of the forward.
Gradient convention: see pympar/nn/parameter.py (param grads +=, activation grads =).
"""
from __future__ import annotations

import numpy as np

from ...nn.attention_core import AttentionModule, CausalAttentionCore
from ..shard import even_slice, stacked_slices
from .collectives import as_collectives
from .linear import ColumnParallelLinear, RowParallelLinear


class TPCausalSelfAttention(AttentionModule):
    def __init__(self, n_embd, n_head, tp, *, name, seed=0, dtype=np.float32, bias=True, n_layer=1,
                 sequence_parallel=False, compute_dtype=None):
        tpc = as_collectives(tp)
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
        if n_head % tpc.size:
            raise ValueError(f"n_head={n_head} is not divisible by tp={tpc.size}")
        self.n_head_local = n_head // tpc.size
        self.head_size = n_embd // n_head
        heads = even_slice(n_head, tpc.size, tpc.rank, "n_head")
        feat = slice(heads.start * self.head_size, heads.stop * self.head_size)   # inside one of q/k/v
        self.c_attn = ColumnParallelLinear(n_embd, 3 * n_embd, tpc, name=f"{name}.c_attn", seed=seed,
                                           dtype=dtype, bias=bias, rows=stacked_slices(3, n_embd, feat),
                                           input_mode="gather_seq" if sequence_parallel else "copy",
                                           compute_dtype=compute_dtype)
        self.c_proj = RowParallelLinear(n_embd, n_embd, tpc, name=f"{name}.c_proj", seed=seed, dtype=dtype,
                                        bias=bias, std=0.02 / (2 * n_layer) ** 0.5,
                                        output_mode="reduce_scatter_seq" if sequence_parallel else "allreduce",
                                        compute_dtype=compute_dtype)
        self.core = CausalAttentionCore()        # the attention math, shared with nn

    def sp_partial_params(self):
        return self.c_proj.sp_partial_params()

    def forward(self, x):                        # x (B, T, C) [SP: (B, T/tp, C)] -> same shape
        qkv, c_in = self.c_attn.forward(x)       # (B, T, 3 * nhl * hs), T full
        B, T, _ = qkv.shape
        ya, core = self.core.forward(qkv.reshape(B, T, 3, self.n_head_local, self.head_size))
        y, _ = self.c_proj.forward(ya)           # ya (B, T, nhl * hs)
        return y, (c_in, core, ya)

    def backward(self, dy, ctx):                 # dy like y -> dx like x
        c_in, core, ya = ctx
        del ctx                                  # (as nn.attention's: each piece let go once used)
        B, T, width = ya.shape
        dya = self.c_proj.backward(dy, ya)       # (B, T, nhl * hs)
        del ya
        dqkv = self.core.backward(dya, core, consume=True)     # (B, T, 3, nhl, hs)
        del dya, core
        return self.c_attn.backward(dqkv.reshape(B, T, 3 * width), c_in)
