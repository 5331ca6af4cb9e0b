"""Products in the compute dtype: a model's master and compute precision, casts, the per-step
cache of each weight's compute-dtype copy, and ``matmul`` / ``linear_bf16`` (which library
multiplies: kernels/gemm.py)."""
from __future__ import annotations

import contextlib
import numpy as np

from .. import kernels
from ..kernels import gemm
from ..backend import dtype as backend_dtype
from ..backend import is_low_precision, lowp_gemm, xp_of
from ..comm.progress import poke


def resolve_precision(dtype, compute_dtype, model: str = "GPT"):
    """(master dtype, compute dtype or None) of a model: master float32/float64; compute
    'float16'/'bfloat16' (or a dtype) for mixed precision, None when it equals the master."""
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"master dtype {dtype} is not supported by {model}: use float32 or float64 "
                         "(and compute_dtype='float16'/'bfloat16' for mixed precision)")
    cdt = None if compute_dtype is None else backend_dtype(compute_dtype)
    return dtype, (None if cdt == dtype else cdt)


def compute_cast(a, cdt):
    """``a`` in the compute dtype (no copy when it already is)."""
    return a if cdt is None or a.dtype == cdt else kernels.cast(a, cdt)


# --- the weight cache: one compute-dtype copy of each weight per step --------------------------
_COPIES = None          # inside a compute_copies() scope: id(Parameter) -> (its data, the copy)


@contextlib.contextmanager
def compute_copies():
    """A scope in which the weights do not change (the forward and backward passes of one optimizer
    step, every micro-batch): ``compute_weight`` casts each weight to the compute dtype once and
    reuses the copy (PyTorch autocast's weight cache), and a bf16 copy is packed once for MKL
    (kernels.gemm.packable). Leaving the scope lets the copies go; outside one, every call casts.
    Nested scopes share the outermost's copies."""
    global _COPIES
    if _COPIES is not None:
        yield
        return
    _COPIES = {}
    try:
        yield
    finally:
        _COPIES = None


def forget(p):
    """p's data was replaced: a cached compute-dtype copy of the old array goes."""
    if _COPIES:
        _COPIES.pop(id(p), None)


def compute_weight(p, cdt):
    """p's data in the compute dtype ``cdt`` (the data itself when it already is, or cdt is None):
    inside ``compute_copies``, the same copy for every call until the scope ends (a data array that
    was replaced -- a ZeRO-3 gather -- is cast again)."""
    d = p.data
    if cdt is None or d.dtype == cdt:
        return d
    if _COPIES is None:
        return kernels.cast(d, cdt)
    hit = _COPIES.get(id(p))
    if hit is not None and hit[0] is d:
        return hit[1]
    w = kernels.cast(d, cdt)
    if type(w) is np.ndarray and w.ndim == 2:
        gemm.packable(w)
    _COPIES[id(p)] = (d, w)
    return w


def matmul(a, b, out_dtype=None, out=None, accumulate=False):
    """a @ b; float16/bfloat16 operands are multiplied with float32 accumulation (like tensor
    cores; on CuPy by cuBLAS on the tensor cores themselves) and the product rounded to
    ``out_dtype`` (default: the operands' dtype). ``out``: an array (a view is fine, e.g. one
    slot of a packed tensor) of the product's shape and dtype to write into; it is returned.

    One difference between the devices: on NumPy the float32 product is rounded once, to
    out_dtype (a float32 out_dtype keeps it whole); cuBLAS through CuPy returns the product in
    the operands' dtype, so on a GPU a wider out_dtype (weight gradients, tensor-parallel
    partial sums) widens an already-rounded product -- what PyTorch autocast does too. The GPU
    tests compare low-precision runs within bf16/fp16 tolerance for this reason.

    ``accumulate=True``: out += a @ b (out required, of the product's shape). MKL adds the product
    in the GEMM itself (beta = 1: no temporary, no second pass over out); elsewhere the product
    is formed (in out's dtype) and added, as ``accumulate`` below does.

    Each product is a seam at which exchanges in flight behind this compute progress
    (comm.progress.poke: nothing to do outside DualPipeV's overlapped pairs)."""
    poke()
    if accumulate:
        if out is None:
            raise ValueError("matmul: accumulate=True needs an out to add the product to")
        if type(a) is np.ndarray and out.dtype == a.dtype and \
                gemm.product(a, b, out, kernels.get_num_threads(), accumulate=True) is not None:
            return out
        if type(a) is np.ndarray and is_low_precision(a.dtype) and \
                gemm.product_bf16(a, b, out, kernels.get_num_threads(), accumulate=True) is not None:
            return out
        out += matmul(a, b, out.dtype)
        return out
    if is_low_precision(a.dtype) and not lowp_gemm(a):   # NumPy: no float16/bf16 GEMM of its own
        y = _bf16_product(a, b, out_dtype, out)                       # the CPU's matrix engines (MKL)
        if y is not None:
            return y
        # no native bf16 products here: widened exactly to float32, multiplied there, rounded once
        y = matmul(kernels.cast(a, np.float32), kernels.cast(b, np.float32))
        if out is not None:
            out[...] = y if out.dtype == y.dtype else kernels.cast(y, out.dtype)
            return out
        dt = np.dtype(out_dtype or a.dtype)
        return y if dt == y.dtype else kernels.cast(y, dt)
    if out is not None and out_dtype is not None and out.dtype != out_dtype:
        raise ValueError(f"matmul: out has dtype {out.dtype}, out_dtype asks for {out_dtype}")
    if type(a) is np.ndarray and (out_dtype is None or out_dtype == a.dtype):   # MKL, where selected
        y = gemm.product(a, b, out, kernels.get_num_threads())
        if y is not None:
            return y
    if out is not None:
        if out.dtype == a.dtype:
            return xp_of(a).matmul(a, b, out=out)   # BLAS writes a strided view directly
        out[...] = a @ b
        return out
    y = a @ b
    return y if out_dtype is None else y.astype(out_dtype, copy=False)


def _bf16_product(a, b, out_dtype, out, bias=None, gelu_out=None):
    """a @ b (+ bias, and GELU of it into gelu_out) on MKL's bf16 GEMM for NumPy bf16 operands, into
    ``out`` or a new array of ``out_dtype`` (bf16 by default, or float32); None when it cannot run
    there (no MKL, a layout it cannot read): the caller takes another path."""
    if type(a) is not np.ndarray or type(b) is not np.ndarray or a.ndim != 2 or b.ndim != 2:
        return None
    if out is None:
        dt = np.dtype(out_dtype) if out_dtype is not None else a.dtype
        if dt == np.float32:
            out = np.empty((a.shape[0], b.shape[1]), np.float32)
        elif dt != a.dtype:
            return None
    return gemm.product_bf16(a, b, out, kernels.get_num_threads(), bias=bias, gelu_out=gelu_out)


def linear_bf16(x2, wt, out=None, bias=None, gelu_out=None):
    """x2 (N, in) @ wt (in, out) in bf16 with its epilogue fused: round(x2 wt + bias) and, with
    ``gelu_out``, round(GELU(that)) too; None where MKL's bf16 GEMM cannot run it."""
    return _bf16_product(x2, wt, None, out, bias, gelu_out)
