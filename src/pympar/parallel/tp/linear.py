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
Mixed precision (``compute_dtype`` float16/bfloat16, as in pympar.nn.Linear): weights are cast
to the compute dtype for the GEMMs, which accumulate in float32; gradients go into the float32
master grads. A partial sum over tp (the row-parallel output, the column-parallel input
gradient) is kept in float32 through its reduction and rounded to the compute dtype once, after
it, so the result is the single-process GEMM's float32 sum rounded once (with tp = 1 exactly
nn.Linear's numbers). With mode "none" the float32 partial is returned for the caller to reduce.
Gradient convention: see pympar/nn/parameter.py (param grads +=, activation grads =).
"""
from __future__ import annotations

import numpy as np

from ... import kernels
from ...nn.module import Module
from ...nn.products import compute_cast, compute_weight, linear_bf16, matmul
from ...nn.wgrad import product_grad, weight_grad
from ..shard import even_slice, make_replicated, make_sharded
from .collectives import as_collectives

_IN_MODES = ("copy", "gather_seq", "none")
_OUT_MODES = ("allreduce", "reduce_scatter_seq", "none")


def partial_dtype(cdt, master_dtype):
    """The dtype a partial sum over tp is kept in: float32 under mixed precision, else None
    (the operands' own dtype)."""
    return None if cdt is None else (np.float64 if np.dtype(master_dtype) == np.float64 else np.float32)


def _fused(x, w, bias):                          # x (..., k) @ w (n, k).T + bias, bf16 epilogue, or None
    x2 = x.reshape(-1, x.shape[-1])
    b = bias.data if bias is not None else None
    y = linear_bf16(x2, w.T, None, b if b is not None and b.dtype == np.float32 else None) \
        if (bias is None or b.dtype == np.float32) else None
    return None if y is None else y.reshape(*x.shape[:-1], y.shape[-1])


def _gemm(x, w, out_dtype=None, out=None):      # x (..., k) @ w (n, k).T -> (..., n): one GEMM
    y = matmul(x.reshape(-1, x.shape[-1]), w.T, out_dtype, None if out is None else out.reshape(-1, w.shape[0]))
    return y.reshape(*x.shape[:-1], y.shape[-1])


class ColumnParallelLinear(Module):
    def __init__(self, n_in, n_out, tp, *, name, seed=0, dtype=np.float32, bias=True, std=0.02,
                 rows=None, input_mode="copy", compute_dtype=None):
        """rows: this rank's output rows (a slice or a tuple of slices into range(n_out));
        default the rank's equal contiguous part."""
        if input_mode not in _IN_MODES:
            raise ValueError(f"input_mode={input_mode!r}: expected one of {_IN_MODES}")
        self._tp = as_collectives(tp)
        rows = even_slice(n_out, self._tp.size, self._tp.rank, f"{name} output width") if rows is None else rows
        self.weight = make_sharded(seed, f"{name}.weight", (n_out, n_in), (rows, slice(None)), dtype, std)
        self.bias = make_sharded(seed, f"{name}.bias", (n_out,), (rows,), dtype) if bias else None
        self._mode = input_mode
        self._cdt, self._pdt = compute_dtype, partial_dtype(compute_dtype, dtype)

    def sp_partial_params(self):
        return []

    def forward(self, x):                        # x (..., in) [or (B, T/tp, in) gathered] -> (..., out/tp)
        xf = self._tp.allgather_seq(x) if self._mode == "gather_seq" else x
        w = compute_weight(self.weight, self._cdt)
        # bf16: round(x W^T + b) with the float32 bias, in the GEMM's epilogue -- nn.Linear's numbers
        # for these output columns, so a column-parallel layer gives the single process's bits
        y = _fused(xf, w, self.bias) if self._cdt is not None else None
        if y is None:
            y = _gemm(xf, w)
            if self.bias is not None:
                y += compute_cast(self.bias.data, self._cdt)
        return y, x                              # ctx: the LOCAL input only

    def backward(self, dy, x):                   # dy (..., out/tp) -> dx like x
        # partial: this rank's output rows only (float32 under mixed precision)
        dx = _gemm(dy, compute_weight(self.weight, self._cdt).T, self._pdt)
        # "copy": the allreduce of dx runs while the weight gradient is computed (overlap)
        pending = self._tp.allreduce_start(dx) if self._mode == "copy" else None
        xf = self._tp.allgather_seq(x) if self._mode == "gather_seq" else x   # the collective stays in B
        dy2 = dy.reshape(-1, dy.shape[-1])
        w, b = self.weight, self.bias            # the W pass (deferrable)
        x2 = xf.reshape(-1, xf.shape[-1])
        product_grad(w, dy2.T, x2)
        if b is not None:
            weight_grad(b, lambda: kernels.column_sum(dy2, b.dtype),
                        into=lambda o: kernels.column_sum(dy2, o.dtype, out=o))
        if pending is not None:
            dx = pending.wait()
        elif self._mode == "gather_seq":
            dx = self._tp.reduce_scatter_seq(dx)
        elif self._mode == "none":
            return dx                            # the caller reduces the (float32) partial
        return dx if self._cdt is None else kernels.cast(dx, self._cdt)


class RowParallelLinear(Module):
    def __init__(self, n_in, n_out, tp, *, name, seed=0, dtype=np.float32, bias=True, std=0.02,
                 output_mode="allreduce", compute_dtype=None):
        if output_mode not in _OUT_MODES:
            raise ValueError(f"output_mode={output_mode!r}: expected one of {_OUT_MODES}")
        self._tp = as_collectives(tp)
        cols = even_slice(n_in, self._tp.size, self._tp.rank, f"{name} input width")
        self.weight = make_sharded(seed, f"{name}.weight", (n_out, n_in), (slice(None), cols), dtype, std)
        self.bias = make_replicated(seed, f"{name}.bias", (n_out,), dtype) if bias else None
        self._mode = output_mode
        self._cdt, self._pdt = compute_dtype, partial_dtype(compute_dtype, dtype)

    def sp_partial_params(self):
        return [self.bias] if self._mode == "reduce_scatter_seq" and self.bias is not None else []

    def forward(self, x):                        # x (..., in/tp) -> y (..., out) [(B, T/tp, out) scattered]
        y = _gemm(x, compute_weight(self.weight, self._cdt), self._pdt)   # partial sum over tp
        if self._mode == "none":
            return y, x                          # the caller reduces the (float32) partial
        if self._mode == "allreduce":
            y = self._tp.allreduce(y)
        elif self._mode == "reduce_scatter_seq":
            y = self._tp.reduce_scatter_seq(y)
        if self.bias is not None and self._cdt is not None and y.dtype == self.bias.dtype:
            y = y + self.bias.data               # the float32 bias added before the one rounding, as
            return kernels.cast(y, self._cdt), x  # nn.Linear's bf16 epilogue adds it
        if self._cdt is not None:
            y = kernels.cast(y, self._cdt)       # rounded once, after the float32 reduction
        if self.bias is not None:
            y = y + compute_cast(self.bias.data, self._cdt)
        return y, x

    def backward(self, dy, x, out=None):         # dy like y -> dx (..., in/tp); out: as nn.Linear's
        w, b = self.weight, self.bias            # the W pass (deferrable): db, dW
        if b is not None and self._mode != "none":
            weight_grad(b, lambda: kernels.column_sum(dy.reshape(-1, dy.shape[-1]), b.dtype))
        dyf = self._tp.allgather_seq(dy) if self._mode == "reduce_scatter_seq" else dy
        dy2 = dyf.reshape(-1, dyf.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        product_grad(w, dy2.T, x2)
        return _gemm(dyf, compute_weight(w, self._cdt).T, out=out)
