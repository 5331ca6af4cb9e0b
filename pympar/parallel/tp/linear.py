"""Megatron's column- and row-parallel Linear layers (W (out, in) like torch.nn.Linear).

ColumnParallelLinear: each tp rank holds some OUTPUT rows of W (and of b); its input is the full
activation. The collective sits on the input side:
  input_mode="copy"        forward identity, backward allreduce of dx   (Megatron's f); the
                           allreduce is started nonblocking and overlaps the weight gradient
  input_mode="gather_seq"  forward allgather along T, backward reduce-scatter of dx along T
                           (sequence parallelism; ctx keeps only the LOCAL x and re-gathers it)
  input_mode="none"        no collective (the caller reduces dx)
RowParallelLinear: each rank holds some INPUT columns of W; its input is the matching slice of
the features and its output a partial sum, reduced on the output side:
  output_mode="allreduce"           forward allreduce, backward identity  (Megatron's g)
  output_mode="reduce_scatter_seq"  forward reduce-scatter along T, backward allgather of dy
  output_mode="none"                no collective and no bias (the caller reduces and adds it)
The row-parallel bias is replicated and added once after the reduction. Under sequence
parallelism it is added on this rank's rows of the sequence only, so its gradient is a partial
sum over tp: such parameters are listed in ``sp_partial_params()`` and summed over tp once per
micro-batch by the model (see gpt.py).
Gradient convention: see pympar/nn/parameter.py (param grads +=, activation grads =).
"""
from __future__ import annotations

import numpy as np

from ...nn.parameter import Module, accumulate
from ..shard import even_slice, make_replicated, make_sharded
from .collectives import as_collectives

_IN_MODES = ("copy", "gather_seq", "none")
_OUT_MODES = ("allreduce", "reduce_scatter_seq", "none")


class ColumnParallelLinear(Module):
    def __init__(self, n_in, n_out, tp, *, name, seed=0, dtype=np.float32, bias=True, std=0.02,
                 rows=None, input_mode="copy"):
        """rows: this rank's output rows (a slice or a tuple of slices into range(n_out));
        default the rank's equal contiguous part."""
        if input_mode not in _IN_MODES:
            raise ValueError(f"input_mode={input_mode!r}: expected one of {_IN_MODES}")
        self._tp = as_collectives(tp)
        rows = even_slice(n_out, self._tp.size, self._tp.rank, f"{name} output width") if rows is None else rows
        self.weight = make_sharded(seed, f"{name}.weight", (n_out, n_in), (rows, slice(None)), dtype, std)
        self.bias = make_sharded(seed, f"{name}.bias", (n_out,), (rows,), dtype) if bias else None
        self._mode = input_mode

    def sp_partial_params(self):
        return []

    def forward(self, x):                        # x (..., in) [or (B, T/tp, in) gathered] -> (..., out/tp)
        xf = self._tp.allgather_seq(x) if self._mode == "gather_seq" else x
        y = xf @ self.weight.data.T
        if self.bias is not None:
            y += self.bias.data
        return y, x                              # ctx: the LOCAL input only

    def backward(self, dy, x):                   # dy (..., out/tp) -> dx like x
        dx = dy @ self.weight.data               # partial: this rank's output rows only
        # "copy": the allreduce of dx runs while the weight gradient is computed (overlap)
        pending = self._tp.allreduce_start(dx) if self._mode == "copy" else None
        xf = self._tp.allgather_seq(x) if self._mode == "gather_seq" else x
        dy2 = dy.reshape(-1, dy.shape[-1])
        accumulate(self.weight, dy2.T @ xf.reshape(-1, xf.shape[-1]))
        if self.bias is not None:
            accumulate(self.bias, dy2.sum(axis=0))
        if pending is not None:
            return pending.wait()
        if self._mode == "gather_seq":
            return self._tp.reduce_scatter_seq(dx)
        return dx


class RowParallelLinear(Module):
    def __init__(self, n_in, n_out, tp, *, name, seed=0, dtype=np.float32, bias=True, std=0.02,
                 output_mode="allreduce"):
        if output_mode not in _OUT_MODES:
            raise ValueError(f"output_mode={output_mode!r}: expected one of {_OUT_MODES}")
        self._tp = as_collectives(tp)
        cols = even_slice(n_in, self._tp.size, self._tp.rank, f"{name} input width")
        self.weight = make_sharded(seed, f"{name}.weight", (n_out, n_in), (slice(None), cols), dtype, std)
        self.bias = make_replicated(seed, f"{name}.bias", (n_out,), dtype) if bias else None
        self._mode = output_mode

    def sp_partial_params(self):
        return [self.bias] if self._mode == "reduce_scatter_seq" and self.bias is not None else []

    def forward(self, x):                        # x (..., in/tp) -> y (..., out) [(B, T/tp, out) scattered]
        y = x @ self.weight.data.T               # partial sum over tp
        if self._mode == "allreduce":
            y = self._tp.allreduce(y)
        elif self._mode == "reduce_scatter_seq":
            y = self._tp.reduce_scatter_seq(y)
        if self.bias is not None and self._mode != "none":
            y = y + self.bias.data
        return y, x

    def backward(self, dy, x):                   # dy like y -> dx (..., in/tp)
        if self.bias is not None and self._mode != "none":
            accumulate(self.bias, dy.reshape(-1, dy.shape[-1]).sum(axis=0))
        dyf = self._tp.allgather_seq(dy) if self._mode == "reduce_scatter_seq" else dy
        dy2 = dyf.reshape(-1, dyf.shape[-1])
        accumulate(self.weight, dy2.T @ x.reshape(-1, x.shape[-1]))
        return dyf @ self.weight.data
