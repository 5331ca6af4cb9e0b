"""Tensor-parallel MoE: every expert split along its hidden width, routing replicated.

Choice (documented in the package docstring): each tp rank holds ALL experts, each sharded like
the dense TP MLP (c_fc rows / c_proj columns of the 4C hidden width), so n_expert needs no
divisibility by tp and expert parallelism (pympar.parallel.ep, over the data-parallel ranks)
stays orthogonal. The router, top-k, capacity, gates and the aux/z losses run on the full,
replicated token set on every tp rank, exactly as in nn.MoE (this class IS nn.MoE with the
expert seam replaced), so routing decisions and loss terms are identical to the single process.
Per MoE layer: one allreduce of the expert outputs (M, C) in forward, one of the expert input
gradients (M, C) in backward (M = kept assignments).
With sequence parallelism the layer gathers the whole sequence first (the aux loss and the
expert capacity are per micro-batch, over all its tokens) and hands back this rank's rows: the
region is replicated, so its conjugates are allgather / split (no reduction).
"""
from __future__ import annotations

import numpy as np

from ...backend import xp_of
from ...nn.moe import MoE
from ...nn.parameter import compute_cast, weight_grad
from .linear import partial_dtype
from .collectives import as_collectives
from .mlp import TPMLP


class TPMoE(MoE):
    def __init__(self, n_embd, n_expert, tp, *, name, seed=0, dtype=np.float32, bias=True, n_layer=1,
                 sequence_parallel=False, compute_dtype=None, **moe_kw):
        super().__init__(n_embd, n_expert, name=name, seed=seed, dtype=dtype, bias=bias, n_layer=n_layer,
                         compute_dtype=compute_dtype, **moe_kw)
        tpc = as_collectives(tp)
        self._tp, self._sp = tpc, sequence_parallel
        # mixed precision: the experts' partial outputs/input grads are summed over tp in float32
        self._cdt, self._pdt = compute_dtype, partial_dtype(compute_dtype, dtype)
        mk = dict(seed=seed, dtype=dtype, bias=bias, n_layer=n_layer, compute_dtype=compute_dtype)
        # replace the full experts built by nn.MoE with hidden-width shards (same init numbers)
        self.experts = [TPMLP(n_embd, tpc, name=f"{name}.experts.{e}", reduce=False, **mk)
                        for e in range(n_expert)]
        if self.shared is not None:
            self.shared = TPMLP(n_embd, tpc, name=f"{name}.shared", **mk)

    def sp_partial_params(self):
        return []                                # the whole layer runs on the full sequence

    def run_experts(self, xs, counts):           # xs (M, C) grouped by expert -> ys (M, C)
        ys = xp_of(xs).zeros(xs.shape, dtype=self._pdt or xs.dtype)
        ctxs, lo = [], 0
        for e, n in enumerate(counts.tolist()):
            if n:
                ys[lo:lo + n], c = self.experts[e].forward(xs[lo:lo + n])   # partial over tp
                ctxs.append((e, lo, n, c))
            lo += n
        ys = self._tp.allreduce(ys).astype(xs.dtype, copy=False)       # rounded once, after the sum
        for e, lo, n, _ in ctxs:
            b = self.experts[e].c_proj.bias
            if b is not None:
                ys[lo:lo + n] += compute_cast(b.data, self._cdt)
        return ys, ctxs

    def run_experts_backward(self, dys, ctxs):   # dys (M, C) replicated -> dxs (M, C)
        dxs = xp_of(dys).zeros(dys.shape, dtype=self._pdt or dys.dtype)
        for e, lo, n, c in ctxs:
            ex = self.experts[e]
            if ex.c_proj.bias is not None:
                bias, rows = ex.c_proj.bias, dys[lo:lo + n]
                weight_grad(bias, lambda bias=bias, rows=rows: rows.sum(axis=0, dtype=bias.dtype))
            dxs[lo:lo + n] = ex.backward(dys[lo:lo + n], c)               # partial over tp
        return self._tp.allreduce(dxs).astype(dys.dtype, copy=False)

    def forward(self, x):                        # x (B, T, C) [SP: (B, T/tp, C)] -> same shape
        if self._sp:
            x = self._tp.allgather_seq(x)
        y, ctx = super().forward(x)
        return (self._tp.split_seq(y) if self._sp else y), ctx

    def backward(self, dy, ctx, daux=1.0):
        if self._sp:
            dy = self._tp.allgather_seq(dy)
        dx = super().backward(dy, ctx, daux)
        return self._tp.split_seq(dx) if self._sp else dx
