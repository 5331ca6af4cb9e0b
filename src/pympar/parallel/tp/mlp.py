"""Tensor-parallel MLP: c_fc column-parallel (C -> 4C/tp), GELU, c_proj row-parallel (4C/tp -> C).

One collective each way: c_proj's allreduce in forward, c_fc's allreduce of dx in backward
(with sequence parallelism: allgather before c_fc, reduce-scatter after c_proj, and their
conjugates in backward). forward/backward are nn.MLP's own: only the layers differ.
"""
from __future__ import annotations

import numpy as np

from ...nn.layers import MLP
from .collectives import as_collectives
from .linear import ColumnParallelLinear, RowParallelLinear


class TPMLP(MLP):
    rowwise = False                              # its layers' collectives take every row at once

    def __init__(self, n_embd, tp, *, name, seed=0, dtype=np.float32, bias=True, n_layer=1,
                 sequence_parallel=False, reduce=True, compute_dtype=None):
        """reduce=False: no collective at all and no c_proj bias in forward/backward (the caller
        reduces the partial output and adds ``c_proj.bias``: used for MoE experts)."""
        tpc = as_collectives(tp)
        if not reduce:
            in_mode, out_mode = "none", "none"
        elif sequence_parallel:
            in_mode, out_mode = "gather_seq", "reduce_scatter_seq"
        else:
            in_mode, out_mode = "copy", "allreduce"
        self.c_fc = ColumnParallelLinear(n_embd, 4 * n_embd, tpc, name=f"{name}.c_fc", seed=seed,
                                         dtype=dtype, bias=bias, input_mode=in_mode, compute_dtype=compute_dtype)
        self.c_proj = RowParallelLinear(4 * n_embd, n_embd, tpc, name=f"{name}.c_proj", seed=seed,
                                        dtype=dtype, bias=bias, std=0.02 / (2 * n_layer) ** 0.5,
                                        output_mode=out_mode, compute_dtype=compute_dtype)

    def sp_partial_params(self):
        return self.c_proj.sp_partial_params()
