"""Vocab-parallel token embedding + replicated position embedding.

wte (V, C) is split by rows over tp after padding V to a multiple of tp: rank r owns token ids
[r*P, (r+1)*P) with P = ceil(V/tp), of which only the real ones (< V) are stored (the Shard is
exactly those rows of the full tensor; the last ranks may hold fewer rows, or none). A rank
looks up the tokens it owns, zeros elsewhere, and the partial embeddings are summed over tp:
allreduce (replicated output) or, with sequence parallelism, reduce-scatter along T (this
rank's rows of the sequence). wpe is replicated; with sequence parallelism each rank adds and
differentiates only its positions, so wpe's gradient is a partial sum over tp.
"""
from __future__ import annotations

import numpy as np

from ... import kernels
from ...backend import xp_of
from ...nn.layers import TokenEmbedding, position_rows
from ...nn.products import compute_cast
from ..shard import make_replicated, make_sharded, padded_partition, padded_slice
from .collectives import as_collectives


class VocabParallelEmbedding(TokenEmbedding):
    def __init__(self, vocab_size, block_size, n_embd, tp, *, seed=0, dtype=np.float32,
                 sequence_parallel=False, prefix="transformer", compute_dtype=None):
        tpc = as_collectives(tp)
        self._tp, self._sp = tpc, sequence_parallel
        self._cdt = compute_dtype               # output cast to it (the sum itself in the master dtype)
        self.vocab_size = vocab_size
        self.vocab_padded, self.vocab_part = padded_partition(vocab_size, tpc.size)
        rows = padded_slice(vocab_size, tpc.size, tpc.rank)
        self.vocab_lo = rows.start               # first token id of this rank's part
        self.wte = make_sharded(seed, f"{prefix}.wte.weight", (vocab_size, n_embd), (rows, slice(None)), dtype)
        self.wpe = make_replicated(seed, f"{prefix}.wpe.weight", (block_size, n_embd), dtype)

    def _named_parameters(self, prefix):
        pre = f"{prefix}." if prefix else ""
        yield f"{pre}wte.weight", self.wte
        yield f"{pre}wpe.weight", self.wpe

    def sp_partial_params(self):
        return [self.wpe] if self._sp else []

    def _local(self, idx):                       # token ids -> (rows in wte shard, owned mask)
        loc = idx - self.vocab_lo
        own = (loc >= 0) & (loc < self.wte.data.shape[0])
        return xp_of(loc).where(own, loc, 0), own


    def _positions(self, T):
        return position_rows(self, T, self._tp.seq_slice(T) if self._sp else None)

    def forward(self, idx):                      # idx (B, T) -> x (B, T, C) [SP: (B, T/tp, C)]
        B, T = idx.shape
        if T > self.wpe.data.shape[0]:
            raise ValueError(f"sequence length T={T} exceeds block_size={self.wpe.data.shape[0]}")
        xp = xp_of(self.wte.data)
        idx = xp.asarray(idx)                    # token ids on wte's device (a no-op when already there)
        loc, own = self._local(idx)
        part = xp.zeros((B, T, self.wte.data.shape[1]), dtype=self.wte.data.dtype)
        part[own] = self.wte.data[loc[own]]                 # (B, T, C), zeros for foreign tokens
        x = self._tp.reduce_scatter_seq(part) if self._sp else self._tp.allreduce(part)
        return compute_cast(x + self.wpe.data[self._positions(T)], self._cdt), idx

    def backward(self, dx, idx):                 # dx like x -> None
        B, T = idx.shape
        C = dx.shape[-1]
        self.wpe.grad[self._positions(T)] += dx.sum(axis=0, dtype=self.wpe.grad.dtype)
        dfull = (self._tp.allgather_seq(dx) if self._sp else dx).astype(self.wte.grad.dtype, copy=False)  # (B, T, C)
        loc, own = self._local(idx)
        kernels.scatter_add(self.wte.grad, loc[own], dfull[own].reshape(-1, C))
        return None
