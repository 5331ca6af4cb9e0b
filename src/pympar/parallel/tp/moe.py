"""Tensor-parallel MoE: routing replicated over tp; experts split along their hidden width over tp,
or folded apart from it.

Choice (documented in the package docstring): by default each tp rank holds ALL experts, each
sharded like the dense TP MLP (c_fc rows / c_proj columns of the 4C hidden width), so n_expert
needs no divisibility by tp and expert parallelism (pympar.parallel.ep, over the data-parallel
ranks) stays orthogonal. The router, top-k, capacity, gates and the aux/z losses run on the full,
replicated token set on every tp rank, exactly as in nn.MoE (this class IS nn.MoE with the
expert seam replaced), so routing decisions and loss terms are identical to the single process.
Per MoE layer: one allreduce of the expert outputs (M, C) in forward, one of the expert input
gradients (M, C) in backward (M = kept assignments).

Folded (parallel.mesh: etp < tp; Megatron-Core's "parallel folding"). The experts have their own
tensor-parallel group, ``etp`` (a divisor of tp; with 1 rank every expert is whole, a plain
nn.MLP, and the products are the grouped ones), and the tp group's ranks, which all route the
same tokens, split the M kept rows (in their expert-major order) into tp/etp contiguous shares
over ``fold``: share f is rows [f*L, min(M, (f+1)*L)), L = ceil(M / (tp/etp)). A rank runs its
share through the experts (over the ep group when expert parallelism is installed: ep may then
reach over tp ranks) and one allgather over ``fold`` gives every rank all M outputs, which
combine as before; backward does the same with the rows' gradients. The router's gradient is the
full one on every tp rank, as unfolded. An expert sees each row once over the stage, so its
gradient summed over its edp group is the whole micro-batch streams' (mesh.expert_grad_scale).

With sequence parallelism the layer gathers the whole sequence first (the aux loss and the
expert capacity are per micro-batch, over all its tokens) and hands back this rank's rows: the
region is replicated, so its conjugates are allgather / split (no reduction).
"""
from __future__ import annotations

import numpy as np

from ...backend import to_numpy, xp_of
from ...nn.moe import MoE
from ...nn.products import compute_cast
from ...nn.wgrad import weight_grad
from ..placement import place
from .linear import partial_dtype
from .collectives import as_collectives
from .mlp import TPMLP


class TPMoE(MoE):
    def __init__(self, n_embd, n_expert, tp, *, name, seed=0, dtype=np.float32, bias=True, n_layer=1,
                 sequence_parallel=False, compute_dtype=None, etp=None, fold=None, **moe_kw):
        super().__init__(n_embd, n_expert, name=name, seed=seed, dtype=dtype, bias=bias, n_layer=n_layer,
                         compute_dtype=compute_dtype, **moe_kw)
        tpc = as_collectives(tp)
        self._tp, self._sp = tpc, sequence_parallel
        self._etp = tpc if etp is None else as_collectives(etp)
        self._fold = None if fold is None or fold.size == 1 else as_collectives(fold)
        if self._etp.size * (1 if self._fold is None else self._fold.size) != tpc.size:
            raise ValueError(f"expert tensor parallelism over {self._etp.size} ranks and "
                             f"{1 if self._fold is None else self._fold.size} shares do not make tp={tpc.size}")
        # mixed precision: the experts' partial outputs/input grads are summed over etp in float32
        self._cdt, self._pdt = compute_dtype, partial_dtype(compute_dtype, dtype)
        mk = dict(seed=seed, dtype=dtype, bias=bias, n_layer=n_layer, compute_dtype=compute_dtype)
        if self._etp.size > 1:   # replace nn.MoE's whole experts with hidden-width shards (same init numbers)
            self.experts = [TPMLP(n_embd, self._etp, name=f"{name}.experts.{e}", reduce=False, **mk)
                            for e in range(n_expert)]
        if self.shared is not None:
            self.shared = TPMLP(n_embd, tpc, name=f"{name}.shared", **mk)
        if self._fold is not None:   # folded: the experts' own grid, their gradients reduced over edp
            place([p for e in self.experts for p in e.parameters()], group="edp")

    def sp_partial_params(self):
        return []                                # the whole layer runs on the full sequence

    def run_experts(self, xs, counts, experts=None):   # xs (M, C) grouped by expert -> ys (M, C)
        if self._etp.size == 1:                  # whole experts: nn.MoE's (grouped) products
            return super().run_experts(xs, counts, experts)
        mods = self.experts if experts is None else experts
        ys = xp_of(xs).zeros(xs.shape, dtype=self._pdt or xs.dtype)
        ctxs, lo = [], 0
        for e, n in enumerate(counts.tolist()):
            if n:
                ys[lo:lo + n], c = mods[e].forward(xs[lo:lo + n])   # partial over etp
                ctxs.append((e, lo, n, c))
            lo += n
        ys = self._etp.allreduce(ys).astype(xs.dtype, copy=False)       # rounded once, after the sum
        for e, lo, n, _ in ctxs:
            b = mods[e].c_proj.bias
            if b is not None:
                ys[lo:lo + n] += compute_cast(b.data, self._cdt)
        return ys, (mods, ctxs)

    def run_experts_backward(self, dys, ctx):    # dys (M, C) replicated over etp -> dxs (M, C)
        if self._etp.size == 1:
            return super().run_experts_backward(dys, ctx)
        mods, ctxs = ctx
        dxs = xp_of(dys).zeros(dys.shape, dtype=self._pdt or dys.dtype)
        for e, lo, n, c in ctxs:
            ex = mods[e]
            if ex.c_proj.bias is not None:
                bias, rows = ex.c_proj.bias, dys[lo:lo + n]
                weight_grad(bias, lambda bias=bias, rows=rows: rows.sum(axis=0, dtype=bias.dtype))
            dxs[lo:lo + n] = ex.backward(dys[lo:lo + n], c)               # partial over etp
        return self._etp.allreduce(dxs).astype(dys.dtype, copy=False)

    # --- folded: this rank's share of the rows, the rest gathered --------------------------------
    def _share(self, counts):
        """(a, b, L, share counts (E,) host int64): rows [a, b) of the M expert-major rows are this
        rank's (share fold.rank of ceil(M / fold.size) rows), share[e] of them expert e's."""
        c = np.asarray(to_numpy(counts), np.int64)  # host: the counts size the messages
        M, F, f = int(c.sum()), self._fold.size, self._fold.rank
        L = -(-M // F)
        a, b = min(M, f * L), min(M, (f + 1) * L)
        ends = np.cumsum(c)  # host
        return a, b, L, np.clip(np.minimum(ends, b) - np.maximum(ends - c, a), 0, None)  # host

    def _gather_rows(self, part, L, M):
        """Every share's rows (at most L each, in share order) -> the (M, C) rows on every rank."""
        if L == 0:
            return part
        buf = xp_of(part).zeros((L,) + part.shape[1:], part.dtype)
        buf[:part.shape[0]] = part
        return self._fold.allgather0(buf)[:M]

    def run_assignments(self, xs, counts):
        if self._fold is None:
            return super().run_assignments(xs, counts)
        a, b, L, share = self._share(counts)
        ys, ctx = super().run_assignments(xs[a:b], share)   # over ep when installed: a collective on every rank
        return self._gather_rows(ys, L, xs.shape[0]), (a, b, L, ctx)

    def run_assignments_backward(self, dys, ctx):
        if self._fold is None:
            return super().run_assignments_backward(dys, ctx)
        a, b, L, inner = ctx
        return self._gather_rows(super().run_assignments_backward(dys[a:b], inner), L, dys.shape[0])

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
