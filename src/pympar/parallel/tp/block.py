"""Tensor-parallel transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x)) (or + moe(...)).

forward/backward are nn.Block's own; only the sub-modules are tensor-parallel. Two allreduces
in forward (attention c_proj, MLP c_proj) and two in backward (the column-parallel inputs).
With sequence parallelism x is (B, T/tp, C): the LayerNorms and the residual adds run on this
rank's rows of the sequence, and each allreduce becomes an allgather before the column-parallel
layer plus a reduce-scatter after the row-parallel one. The LayerNorm parameters then see only
this rank's rows: their gradients are partial sums over tp (``sp_partial_params``).
"""
from __future__ import annotations

import numpy as np

from ...nn.config import GPTConfig
from ...nn.gpt import Block
from ...nn.layers import LayerNorm
from .attention import TPCausalSelfAttention
from .collectives import as_collectives
from .mlp import TPMLP
from .moe import TPMoE


class TPBlock(Block):
    def __init__(self, config: GPTConfig, i: int, tp, *, seed=0, dtype=np.float32,
                 sequence_parallel=False, compute_dtype=None, etp=None, fold=None):
        c = config
        tpc = as_collectives(tp)
        name = f"transformer.h.{i}"
        mk = dict(seed=seed, dtype=dtype, bias=c.bias, n_layer=c.n_layer, sequence_parallel=sequence_parallel,
                  compute_dtype=compute_dtype)
        self._sp = sequence_parallel
        self.ln_1 = LayerNorm(c.n_embd, name=f"{name}.ln_1", dtype=dtype, bias=c.bias, eps=c.ln_eps)
        self.attn = TPCausalSelfAttention(c.n_embd, c.n_head, tpc, name=f"{name}.attn", **mk)
        self.ln_2 = LayerNorm(c.n_embd, name=f"{name}.ln_2", dtype=dtype, bias=c.bias, eps=c.ln_eps)
        if c.is_moe_block(i):
            self.moe = TPMoE(c.n_embd, c.n_expert, tpc, name=f"{name}.moe", top_k=c.top_k,
                             capacity_factor=c.capacity_factor, aux_coef=c.aux_coef, z_coef=c.z_coef,
                             shared_expert=c.shared_expert, bias_update_rate=c.bias_update_rate, etp=etp, fold=fold,
                             **mk)
        else:
            self.mlp = TPMLP(c.n_embd, tpc, name=f"{name}.mlp", **mk)

    def sp_partial_params(self):
        """Replicated parameters whose gradient is a partial sum over tp (sequence parallelism)."""
        if not self._sp:
            return []
        return (self.ln_1.parameters() + self.ln_2.parameters() + self.attn.sp_partial_params()
                + self.ffn.sp_partial_params())
