"""CuPy arrays -> the CUDA kernels of ``pympar._cuda``.

Each function has the signature of its twin in :mod:`pympar.kernels.reference`, routes what the
kernels do not cover to the reference, allocates the outputs and passes the arrays themselves
(the bindings check their dtypes, sizes, C order and device again before any launch), and launches on CuPy's current stream (asynchronously, like CuPy's own
operations). Storage float32, float16 or bfloat16, math in float32; statistics (layernorm
mean/rstd, cross-entropy loss/lse) and layernorm dw/db are float32, as in the reference. What
is not covered (float64 math, k > 16 in top-k, more than 256 experts) goes to the reference,
which runs on CuPy unchanged.

Differences from the reference, by design: cross-entropy with a target >= V gives NaN for that
row (a device cannot raise); unpermute_add accumulates each output row in float32 (the reference
adds in the storage dtype).
"""
from __future__ import annotations

import cupy as cp
import numpy as np

from .. import _cuda
from . import reference

_OPS = {"sum": 0, "max": 1, "min": 2, "prod": 3}
_FLOAT_CODES = (0, 2, 3)


def _code(dt) -> int:
    dt = np.dtype(dt)
    if dt.name == "bfloat16":
        return 3
    return {"float32": 0, "float64": 1, "float16": 2, "int32": 4, "int64": 5}.get(dt.name, -1)


def _stream() -> int:
    return cp.cuda.get_current_stream().ptr


def _on_device(*arrays) -> bool:
    dev = cp.cuda.Device().id
    return all(isinstance(a, cp.ndarray) and a.device.id == dev for a in arrays)


def _c(a):
    return cp.ascontiguousarray(a)


def _float(*arrays) -> bool:
    c = _code(arrays[0].dtype)
    return c in _FLOAT_CODES and all(a.dtype == arrays[0].dtype for a in arrays) and _on_device(*arrays)


def _p(a) -> int:
    return a.data.ptr


# --- causal softmax ------------------------------------------------------------------------
def softmax_causal_forward(x, out=None):
    if not _float(x) or x.ndim < 2 or x.shape[-1] != x.shape[-2]:
        return reference.softmax_causal_forward(x, out=out)
    x = _c(x)
    direct = (out is not None and out.dtype == x.dtype and out.shape == x.shape and out.flags.c_contiguous
              and _on_device(out) and _p(out) != _p(x))        # the kernel writes straight into out
    y = out if direct else cp.empty_like(x)
    _cuda.softmax_causal_forward(x, y, _stream())
    if out is not None and not direct:
        out[...] = y
        return out
    return y


def softmax_causal_backward(y, dy):
    if not _float(y, dy) or y.shape != dy.shape or y.ndim < 2 or y.shape[-1] != y.shape[-2]:
        return reference.softmax_causal_backward(y, dy)
    y, dy = _c(y), _c(dy)
    dx = cp.empty_like(y)
    _cuda.softmax_causal_backward(y, dy, dx, _stream())
    return dx


# --- layernorm -----------------------------------------------------------------------------
def layernorm_forward(x, w, b, eps=1e-5):
    if not _float(x, w, b) or x.ndim < 1 or w.shape != x.shape[-1:] or b.shape != w.shape:
        return reference.layernorm_forward(x, w, b, eps)
    x, w, b = _c(x), _c(w), _c(b)
    y = cp.empty_like(x)
    mean = cp.empty(x.shape[:-1], dtype=cp.float32)
    rstd = cp.empty(x.shape[:-1], dtype=cp.float32)
    _cuda.layernorm_forward(x, w, b, y, mean, rstd, float(eps), _stream())
    return y, mean, rstd


def add_layernorm_forward(x, res, w, b, eps=1e-5):
    x += res                                     # (no fused CUDA kernel: the add, then the kernel)
    return layernorm_forward(x, w, b, eps)


def layernorm_backward(dy, x, w, mean, rstd, residual=None):
    if not _float(x, dy, w) or not _on_device(mean, rstd) or dy.shape != x.shape or w.shape != x.shape[-1:] \
            or mean.shape != x.shape[:-1] or rstd.shape != mean.shape:
        return reference.layernorm_backward(dy, x, w, mean, rstd, residual)
    dy, x, w = _c(dy), _c(x), _c(w)
    mean, rstd = _c(mean.astype(cp.float32, copy=False)), _c(rstd.astype(cp.float32, copy=False))
    C = x.shape[-1]
    N = x.size // max(C, 1)
    dx = cp.empty_like(x)
    dw = cp.empty(C, dtype=cp.float32)
    db = cp.empty(C, dtype=cp.float32)
    scratch = cp.empty(max(1, _cuda.layernorm_backward_scratch(N, C)), dtype=cp.float32)
    _cuda.layernorm_backward(dy, x, w, mean, rstd, dx, dw, db, scratch, _stream())
    if residual is not None:                     # (no fused CUDA kernel: the add after it)
        dx += residual
    return dx, dw, db


# --- GELU ----------------------------------------------------------------------------------
def gelu_forward(x):
    if not _float(x):
        return reference.gelu_forward(x)
    x = _c(x)
    y = cp.empty_like(x)
    _cuda.gelu_forward(x, y, _stream())
    return y


def bias_gelu_forward(h, b):
    h += b                                       # (no fused CUDA kernel: the add, then the kernel)
    return gelu_forward(h)


def gelu_backward(x, dy, out=None):
    if (not _float(x, dy) or x.shape != dy.shape
            or (out is not None and not (_on_device(out) and out.flags.c_contiguous and out.dtype == x.dtype
                                         and out.shape == x.shape))):
        return reference.gelu_backward(x, dy, out)
    x, dy = _c(x), _c(dy)
    dx = cp.empty_like(x) if out is None else out    # each element read, then written, by one thread
    _cuda.gelu_backward(x, dy, dx, _stream())
    return dx


# --- causal attention without the (T, T) matrix ----------------------------------------------
def attention_forward(qkv, scale):
    if not _float(qkv) or qkv.ndim != 5 or qkv.shape[2] != 3 or qkv.shape[-1] > 128:
        return reference.attention_forward(qkv, scale)
    B, T, _, H, D = qkv.shape
    qkv = _c(qkv)
    o = cp.empty((B, T, H * D), dtype=qkv.dtype)
    lse = cp.empty((B, H, T), dtype=cp.float32)
    _cuda.attention_forward(qkv, o, lse, float(scale), _stream())
    return o, lse


def attention_backward(qkv, o, lse, dout, scale, overwrite=False):   # (overwrite: a permission,
    if not _float(qkv, o, dout) or qkv.ndim != 5 or qkv.shape[2] != 3 or qkv.shape[-1] > 128 \
            or lse.dtype != cp.float32 or not _on_device(lse):
        return reference.attention_backward(qkv, o, lse, dout, scale)
    B, T, _, H, D = qkv.shape
    qkv, o, lse, dout = _c(qkv), _c(o), _c(lse), _c(dout)
    dqkv = cp.empty_like(qkv)                    # not taken: the twin's blocks read k, v of
    dvec = cp.empty((B, H, T), dtype=cp.float32)  # every query tile from global memory)
    _cuda.attention_backward(qkv, o, lse, dout, dqkv, dvec, float(scale), _stream())
    return dqkv


# --- fused softmax + cross-entropy ---------------------------------------------------------
def cross_entropy_forward(logits, targets):
    if not _float(logits) or logits.ndim != 2:
        return reference.cross_entropy_forward(logits, targets)
    logits = _c(logits)
    t = _c(cp.asarray(targets).astype(cp.int64, copy=False))
    N, V = logits.shape
    loss = cp.empty(N, dtype=cp.float32)
    lse = cp.empty(N, dtype=cp.float32)
    _cuda.cross_entropy_forward(logits, t, loss, lse, _stream())
    return loss, lse


def cross_entropy_backward(logits, lse, targets, dloss, out=None):
    d = cp.asarray(dloss, dtype=cp.float32)
    if (not _float(logits) or logits.ndim != 2 or not _on_device(lse) or d.ndim > 1
            or (out is not None and not (out.flags.c_contiguous and out.dtype == logits.dtype
                                         and out.shape == logits.shape))):
        return reference.cross_entropy_backward(logits, lse, targets, dloss, out)
    N, V = logits.shape
    logits = _c(logits)
    lse = _c(lse.astype(cp.float32, copy=False))
    t = _c(cp.asarray(targets).astype(cp.int64, copy=False))
    d = _c(d.reshape(-1))
    dlogits = cp.empty_like(logits) if out is None else out     # each element read, then written, by one thread
    _cuda.cross_entropy_backward(logits, lse, t, d, dlogits, _stream())
    return dlogits


# --- AdamW (float32 master weights) --------------------------------------------------------
def adamw_step(p, g, m, v, *, lr, beta1, beta2, eps, weight_decay, step):
    ok = (_on_device(p, g, m, v) and all(a.dtype == cp.float32 and a.flags.c_contiguous for a in (p, m, v))
          and _code(g.dtype) in _FLOAT_CODES and g.shape == p.shape == m.shape == v.shape)
    if not ok:
        return reference.adamw_step(p, g, m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                    weight_decay=weight_decay, step=step)
    g = _c(g)
    _cuda.adamw_step(p, g, m, v, float(lr), float(beta1), float(beta2),
                     float(eps), float(weight_decay), float(1 - beta1 ** step), float(1 - beta2 ** step), _stream())


# --- MoE routing helpers -------------------------------------------------------------------
def topk(scores, k):
    if not _float(scores) or scores.ndim != 2 or not 1 <= k <= min(16, scores.shape[1]):
        return reference.topk(scores, k)
    scores = _c(scores)
    N, E = scores.shape
    idx = cp.empty((N, k), dtype=cp.int64)
    vals = cp.empty((N, k), dtype=scores.dtype)
    _cuda.topk(scores, int(k), idx, vals, _stream())
    return idx, vals


def capacity_positions(expert_idx, n_expert, capacity):
    e = _c(cp.asarray(expert_idx).astype(cp.int64, copy=False).reshape(-1))
    if not 1 <= n_expert <= 256:
        return reference.capacity_positions(expert_idx, n_expert, capacity)
    if e.size and (int(e.min()) < 0 or int(e.max()) >= n_expert):  # a bad index would write outside shared memory
        raise IndexError(f"capacity_positions: expert indices must lie in [0, {n_expert})")
    pos = cp.empty(e.size, dtype=cp.int64)
    counts = cp.empty(int(n_expert), dtype=cp.int64)
    _cuda.capacity_positions(e, int(n_expert), int(capacity), pos, counts, _stream())
    return pos, counts


def _rows(rows, n):
    r = cp.asarray(rows)
    if r.ndim != 1 or r.dtype.kind not in "iu" or n == 0:
        return None
    return _c(r.astype(cp.int64) % n)  # negative indices count from the end; CuPy wraps out-of-range ones


def permute(x, rows):
    r = _rows(rows, x.shape[0]) if x.ndim >= 1 and _on_device(x) else None
    if r is None:
        return reference.permute(x, rows)
    x = _c(x)
    out = cp.empty((r.size,) + x.shape[1:], dtype=x.dtype)
    _cuda.permute(x, r, out, _stream())
    return out


def unpermute_add(y, rows, weights, n_rows):
    r = _rows(rows, n_rows) if _float(y) and y.ndim == 2 else None
    if r is None or r.size != y.shape[0]:
        return reference.unpermute_add(y, rows, weights, n_rows)
    y = _c(y)
    order = cp.argsort(r)  # CuPy's sort is stable: each segment keeps the order of i
    offsets = cp.zeros(int(n_rows) + 1, dtype=cp.int64)
    cp.cumsum(cp.bincount(r, minlength=int(n_rows)), out=offsets[1:])
    w = None if weights is None else _c(cp.asarray(weights).astype(y.dtype, copy=False).reshape(-1))
    out = cp.empty((int(n_rows), y.shape[1]), dtype=y.dtype)
    _cuda.unpermute_add(y, _c(order.astype(cp.int64, copy=False)), offsets, w, out, int(n_rows), _stream())
    return out


# --- casts and elementwise reductions ------------------------------------------------------
def cast(x, dtype):
    if _code(x.dtype) not in _FLOAT_CODES or _code(dtype) not in _FLOAT_CODES or not _on_device(x):
        return reference.cast(x, dtype)
    x = _c(x)
    out = cp.empty(x.shape, dtype=dtype)
    _cuda.cast(x, out, _stream())
    return out


def reduce_inplace(dst, src, op="sum"):
    if op not in _OPS:
        raise ValueError(f"unknown reduction op {op!r}: expected sum, max, min or prod")
    if not (_on_device(dst, src) and _code(dst.dtype) >= 0 and dst.flags.c_contiguous and src.dtype == dst.dtype
            and src.shape == dst.shape):
        return reference.reduce_inplace(dst, src, op)
    _cuda.reduce_inplace(dst, _c(src), _OPS[op], _stream())
    return dst


def scale_inplace(x, alpha):
    a = np.asarray(alpha)
    if not (_on_device(x) and _code(x.dtype) >= 0 and x.flags.c_contiguous and a.ndim == 0 and a.dtype.kind in "iuf"):
        return reference.scale_inplace(x, alpha)
    _cuda.scale_inplace(x, float(a), _stream())
    return x
