"""Vocab-parallel fused cross-entropy and the TP head (ln_f + tied lm_head + mean CE).

Each tp rank holds the logits of its vocabulary part only, (N, P) with P = ceil(V/tp); the
columns past V (padding) are -inf, so they add exp(-inf) = 0 to every sum and never hold a
target: the padding cannot change the loss. The full (N, V) logits are never gathered; per row
only two allreduces of (N,)-sized statistics are needed:
  m   = max over ranks of the local row max                     (allreduce max, (N,))
  s, z = sums over ranks of sum(exp(l - m)) and of the target's logit (only its owner has it)
                                                                 (one allreduce sum, (2, N))
  lse = m + log s,  loss = lse - z   (rows with target < 0 are ignored: loss 0)
Backward needs no communication for the logits: dl = (exp(l - lse) - onehot) * dloss.
The three phases are separate functions so the math can be checked on one process.
"""
from __future__ import annotations

import numpy as np

from ... import kernels
from ...backend import xp_of
from ...nn.layers import LayerNorm
from ...nn.module import Module
from ...nn.products import compute_cast, compute_weight, matmul
from ...nn.wgrad import product_grad
from .collectives import as_collectives


def _acc(dt):
    return np.float64 if np.dtype(dt) == np.float64 else np.float32


def local_row_max(logits):                       # logits (N, P) -> (N,)
    return logits.astype(_acc(logits.dtype), copy=False).max(axis=-1)


def local_row_sums(logits, targets, vocab_lo, m):
    """-> (2, N): sum(exp(l - m)) over the local columns, and the target's logit where owned.
    targets may be a host array while logits live on a GPU: they are moved to logits' device."""
    xp = xp_of(logits)
    lf = logits.astype(_acc(logits.dtype), copy=False)
    N, P = lf.shape
    s = xp.exp(lf - m[:, None]).sum(axis=-1)
    loc = xp.asarray(targets).astype(np.int64) - vocab_lo
    own = (loc >= 0) & (loc < P)
    z = xp.zeros(N, dtype=lf.dtype)
    z[own] = lf[xp.flatnonzero(own), loc[own]]
    return xp.stack([s, z])


def finish_loss(m, sums, targets):
    """Global (m (N,), sums (2, N)) -> (loss (N,), lse (N,)); ignored rows get loss 0."""
    xp = xp_of(sums)
    lse = m + xp.log(sums[0])
    valid = xp.asarray(targets) >= 0
    return xp.where(valid, lse - sums[1], 0.0).astype(lse.dtype), lse


def vocab_parallel_cross_entropy_forward(logits, targets, vocab_lo, tp):
    """logits (N, P) this rank's vocabulary part (padding columns -inf), targets (N,) global ids
    -> (loss (N,), lse (N,)), identical on every rank."""
    tpc = as_collectives(tp)
    m = tpc.allreduce(local_row_max(logits), op="max")
    sums = tpc.allreduce(local_row_sums(logits, targets, vocab_lo, m))
    return finish_loss(m, sums, targets)


def vocab_parallel_cross_entropy_backward(logits, lse, targets, vocab_lo, dloss):
    """-> dlogits (N, P) of this rank's part: (softmax - onehot) * dloss; ignored rows 0."""
    xp = xp_of(logits)
    lf = logits.astype(_acc(logits.dtype), copy=False)
    N, P = lf.shape
    p = xp.exp(lf - lse[:, None])
    t = xp.asarray(targets).astype(np.int64)
    loc = t - vocab_lo
    own = (loc >= 0) & (loc < P) & (t >= 0)
    p[xp.flatnonzero(own), loc[own]] -= 1.0
    d = xp.asarray(dloss, dtype=p.dtype)
    p *= (d[:, None] if d.ndim == 1 else d) * (t >= 0)[:, None]
    return p.astype(logits.dtype, copy=False)


class VocabParallelHead(Module):
    """ln_f, lm_head tied to the vocab-parallel wte shard, mean CE over targets >= 0.

    Input x is (B, T, C) replicated, or (B, T/tp, C) with sequence parallelism (gathered after
    ln_f; the input gradient reduce-scattered back)."""

    def __init__(self, config, embedding, tp, *, dtype=np.float32, sequence_parallel=False,
                 compute_dtype=None):
        """compute_dtype: the logits GEMM runs in it (float32 accumulation); the softmax
        statistics are float32 (``_acc``); dh's partial sum over the vocabulary parts is reduced
        in float32 and rounded once."""
        self._tp, self._sp = as_collectives(tp), sequence_parallel
        self._cdt = compute_dtype
        self._pdt = None if compute_dtype is None else _acc(dtype)
        self.ln_f = LayerNorm(config.n_embd, name="transformer.ln_f", dtype=dtype, bias=config.bias,
                              eps=config.ln_eps)
        self._emb = embedding                    # wte is the SAME (sharded) Parameter
        self.vocab_size = config.vocab_size

    @property
    def wte(self):
        return self._emb.wte

    def sp_partial_params(self):
        return self.ln_f.parameters() if self._sp else []

    def _local_logits(self, h2):                 # h2 (N, C) -> (N, P) padded with -inf
        """float32 under mixed precision (the bf16 GEMM's accumulators, as nn.gpt.Head keeps them)."""
        w = compute_weight(self.wte, self._cdt)
        dt = np.float32 if self._cdt is not None else h2.dtype
        out = xp_of(h2).full((h2.shape[0], self._emb.vocab_part), -np.inf, dtype=dt)
        out[:, :w.shape[0]] = matmul(h2, w.T, dt)
        return out

    def _normed_full(self, x):
        h, c_ln = self.ln_f.forward(x)
        return (self._tp.allgather_seq(h) if self._sp else h), c_ln

    def logits(self, x):                         # x -> full logits (B, T, V): gathers (inference only)
        h, _ = self._normed_full(x)
        B, T, C = h.shape
        loc = self._local_logits(h.reshape(B * T, C))                   # (N, P)
        allp = self._tp.allgather0(xp_of(loc).ascontiguousarray(loc.T))  # (tp*P, N)
        return allp[:self.vocab_size].T.reshape(B, T, self.vocab_size)

    def forward(self, inputs):                   # (x, targets (B, T)) -> mean CE (float)
        x, targets = inputs
        h, c_ln = self._normed_full(x)
        B, T, C = h.shape
        h2 = h.reshape(B * T, C)
        logits = self._local_logits(h2)
        t = xp_of(logits).asarray(targets).reshape(-1)           # on the logits' device
        loss_rows, lse = vocab_parallel_cross_entropy_forward(logits, t, self._emb.vocab_lo, self._tp)
        n_valid = int((t >= 0).sum())
        loss = float(loss_rows.sum()) / max(n_valid, 1)
        return loss, (c_ln, h2, logits, lse, t, n_valid, h.shape)

    def backward(self, dloss, ctx):              # dloss: d(total)/d(mean CE) -> dx like x
        c_ln, h2, logits, lse, t, n_valid, shape = ctx
        dl = vocab_parallel_cross_entropy_backward(logits, lse, t, self._emb.vocab_lo,
                                                   dloss / max(n_valid, 1))
        w = self.wte
        dl = compute_cast(dl[:, :w.data.shape[0]], self._cdt)   # without the padding columns (grads 0),
        product_grad(w, dl.T, h2)                # in the compute dtype for both products; the W pass
        dh = matmul(dl, compute_weight(w, self._cdt), self._pdt).reshape(shape)  # partial over the vocabulary parts
        dh = self._tp.reduce_scatter_seq(dh) if self._sp else self._tp.allreduce(dh)
        if self._cdt is not None:
            dh = kernels.cast(dh, self._cdt)
        return self.ln_f.backward(dh, c_ln)
