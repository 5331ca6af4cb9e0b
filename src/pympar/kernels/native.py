"""NumPy arrays -> the C++ kernels of ``pympar._C``.

Each function has the signature of its twin in :mod:`pympar.kernels.reference` and checks
dtype, contiguity and shape before a pointer crosses. What the C++ side does not cover is
handed to the reference, so every call is answered:
- the math kernels (softmax, attention and its blocks, layernorm, GELU, cross-entropy, top-k,
  unpermute_add) run natively on float32 and float64;
- bfloat16 activations with float32 parameters run natively in layernorm (and its fused residual
  add), GELU (and its fused bias), bias_add and column_sum (float32 sums), float32 math inside and
  each output rounded once (csrc/lowp.cpp); attention widens bf16 q, k, v to float32, runs the
  float32 kernel and rounds o and dqkv (lse stays float32); other float16/bfloat16 calls go to
  the reference;
- AdamW runs natively on float32/float64 parameters with a float32/float64/float16/bfloat16
  gradient;
- cast, reduce_inplace and scale_inplace run natively on float16 and bfloat16 too (and the
  reductions and scaling on int32/int64);
- non-contiguous inputs are copied to contiguous ones (the attention blocks read strided views
  of packed arrays in place: the last axis contiguous, the head stride D); a non-contiguous
  in-place target (AdamW's p/m/v, reduce_inplace's dst, scale_inplace's x) goes to the
  reference, which updates it in place.
"""
from __future__ import annotations

import numpy as np

from .. import _C
from . import reference

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
_FLOATS = (F32, F64)


class _Named(frozenset):
    """A set of dtypes by name: ``dt in s`` without importing ml_dtypes for bfloat16's dtype."""

    def __contains__(self, dt):
        return frozenset.__contains__(self, dt.name)


_HALVES = _Named(("float16", "bfloat16"))
_CASTABLE = _Named(("float32", "float64", "float16", "bfloat16"))
_REDUCIBLE = _Named(_CASTABLE | {"int32", "int64"})
_BF16 = _Named(("bfloat16",))
_F32ONLY = (F32,)
_OPS = {"sum": 0, "max": 1, "min": 2, "prod": 3}


def _c(a):
    return np.ascontiguousarray(a)


def _inplace_ok(a, dtypes):
    return (isinstance(a, np.ndarray) and a.dtype in dtypes and a.flags.c_contiguous
            and a.flags.writeable)


def _i64(a):
    return np.ascontiguousarray(a, dtype=np.int64)


def _bf(*arrays):
    """All bfloat16 NumPy arrays (the bf16 kernels' activations)."""
    return all(type(a) is np.ndarray and a.dtype.name == "bfloat16" for a in arrays)


def _f32(*arrays):
    """All float32 NumPy arrays (the bf16 kernels' parameters and statistics)."""
    return all(type(a) is np.ndarray and a.dtype == F32 for a in arrays)


def _bf16_cast(a, dtype):
    """a in ``dtype`` through the native cast (bf16 <-> float32, exact one way, rounded once the other)."""
    out = np.empty(a.shape, dtype=dtype)
    _C.cast(_c(a), out)
    return out


# --- causal softmax ------------------------------------------------------------------------
def softmax_causal_forward(x, out=None):
    if x.dtype not in _FLOATS or x.ndim < 2 or x.shape[-1] != x.shape[-2]:
        return reference.softmax_causal_forward(x, out=out)
    x = _c(x)
    direct = out is not None and _inplace_ok(out, (x.dtype,)) and out.shape == x.shape
    y = out if direct else np.empty_like(x)
    _C.softmax_causal_forward(x, y)
    if out is not None and not direct:
        out[...] = y
        return out
    return y


def softmax_causal_backward(y, dy):
    if y.dtype not in _FLOATS or dy.dtype != y.dtype or y.shape != dy.shape or y.ndim < 2 \
            or y.shape[-1] != y.shape[-2]:
        return reference.softmax_causal_backward(y, dy)
    y, dy = _c(y), _c(dy)
    dx = np.empty_like(y)
    _C.softmax_causal_backward(y, dy, dx)
    return dx


# --- causal attention, tile by tile ---------------------------------------------------------
def _bf16_attention_engine(qkv):
    """bf16 attention on pympar's kernel (csrc/amx_attention.cpp): "amx" (tiles) or "avx512bf16" (dot
    products) where the bf16 products run on that engine and the head size is a multiple of 32, else
    None (widened to the float32 kernel)."""
    from .gemm import OWN_BF16, bf16_engine
    engine = bf16_engine()
    return engine if qkv.shape[4] % 32 == 0 and engine in OWN_BF16 else None


def attention_forward(qkv, scale):
    if _bf(qkv) and qkv.ndim == 5 and qkv.shape[2] == 3:
        B, T, _, H, D = qkv.shape
        engine = _bf16_attention_engine(qkv)
        if engine:
            qkv = _c(qkv)
            o, lse = np.empty((B, T, H * D), qkv.dtype), np.empty((B, H, T), F32)
            _C.amx_attention_forward(qkv, o, lse, float(scale), engine == "amx")
            return o, lse
        o, lse = attention_forward(_bf16_cast(qkv, F32), scale)   # float32 inside: widened exactly,
        return _bf16_cast(o, qkv.dtype), lse                      # o rounded once
    if qkv.dtype not in _FLOATS or qkv.ndim != 5 or qkv.shape[2] != 3:
        return reference.attention_forward(qkv, scale)
    B, T, _, H, D = qkv.shape
    qkv = _c(qkv)
    o = np.empty((B, T, H * D), dtype=qkv.dtype)
    lse = np.empty((B, H, T), dtype=qkv.dtype)
    _C.attention_forward(qkv, o, lse, float(scale))
    return o, lse


def attention_backward(qkv, o, lse, dout, scale, overwrite=False):
    if _bf(qkv, o, dout) and _f32(lse) and qkv.ndim == 5 and qkv.shape[2] == 3:
        engine = _bf16_attention_engine(qkv)
        if engine and o.size == qkv.size // 3 and dout.size == o.size and lse.size * qkv.shape[4] == o.size:
            qkv, o, lse, dout = _c(qkv), _c(o), _c(lse), _c(dout)
            dqkv = qkv if overwrite and qkv.flags.writeable else np.empty_like(qkv)
            _C.amx_attention_backward(qkv, o, lse, dout, dqkv, float(scale), engine == "amx")
            return dqkv
        up = _bf16_cast(qkv, F32)
        g = attention_backward(up, _bf16_cast(o, F32), lse, _bf16_cast(dout, F32), scale, overwrite=True)
        return _bf16_cast(g, qkv.dtype)
    dt = qkv.dtype
    if dt not in _FLOATS or qkv.ndim != 5 or qkv.shape[2] != 3 or any(a.dtype != dt for a in (o, lse, dout)):
        return reference.attention_backward(qkv, o, lse, dout, scale)
    B, T, _, H, D = qkv.shape
    if o.size != B * T * H * D or dout.size != o.size or lse.size != B * H * T:
        raise ValueError(f"attention_backward: o {o.shape}, dout {dout.shape}, lse {lse.shape} do not match "
                         f"qkv {qkv.shape}: expected (B, T, H*D) twice and (B, H, T)")
    qkv, o, lse, dout = _c(qkv), _c(o), _c(lse), _c(dout)
    # overwrite: the kernel reads each head's q, k, v into its own copies before it writes that
    # head's gradients (csrc/attention.cpp), and no head reads another's columns, so dqkv may be qkv
    dqkv = qkv if overwrite and qkv.flags.writeable else np.empty_like(qkv)
    _C.attention_backward(qkv, o, lse, dout, dqkv, float(scale))
    return dqkv


# --- one block of (ring) attention, strided views read in place --------------------------
def _in_place(a):
    """a (B, T, H, D) as the block kernels read it without a copy: the last axis contiguous, the head
    stride D, batch and row strides in whole elements (e.g. qkv[:, :, 0] of packed (B, T, 3, H, D),
    or kv[:, :c, 1]); any other layout is copied."""
    return a if _rows_layout(a) else np.ascontiguousarray(a)


def _rows_layout(a):
    """a (B, T, H, D) in the layout the block kernels read and write through strides (_in_place)."""
    n, st = a.itemsize, [s if d > 1 else 0 for d, s in zip(a.shape, a.strides)]
    return a.size == 0 or (a.flags.aligned and st[3] == (n if a.shape[3] > 1 else 0)
                           and st[2] == (a.shape[3] * n if a.shape[2] > 1 else 0) and st[0] % n == 0
                           and st[1] % n == 0)


def _native_block(*arrays):
    dt = arrays[0].dtype
    return dt in _FLOATS and all(type(a) is np.ndarray and a.dtype == dt for a in arrays)


def attention_block_forward(q, k, v, scale, causal):
    B, Tq, Tk, H, D = reference._block_dims("attention_block_forward", q, k, v, causal)
    if _bf(q, k, v):                             # float32 inside, as attention_forward's bf16 route
        o, lse = attention_block_forward(*(_bf16_cast(a, F32) for a in (q, k, v)), scale, causal)
        return _bf16_cast(o, q.dtype), lse
    if not _native_block(q, k, v):
        return reference.attention_block_forward(q, k, v, scale, causal)
    if Tk == 0 and Tq > 0:
        raise ValueError(f"attention_block_forward: Tk=0, the {Tq} queries have no key to attend to")
    o = np.empty((B, Tq, H * D), dtype=q.dtype)
    lse = np.empty((B, H, Tq), dtype=q.dtype)
    _C.attention_block_forward(_in_place(q), _in_place(k), _in_place(v), o, lse, float(scale), bool(causal))
    return o, lse


def attention_block_backward(q, k, v, o, lse, dout, scale, causal, out=None):
    B, Tq, Tk, H, D = reference._block_dims("attention_block_backward", q, k, v, causal)
    if out is not None:                          # written through their strides where the kernel can
        reference._check_block_out(out, B, Tq, Tk, H, D, q.dtype, dict(q=q, k=k, v=v, o=o, lse=lse, dout=dout))
        if not (_native_block(q, k, v, o, lse, dout, *out)
                and all(a.flags.writeable and _rows_layout(a) for a in out)):
            return reference._write_out(out, attention_block_backward(q, k, v, o, lse, dout, scale, causal))
    if _bf(q, k, v, o, dout) and _f32(lse):
        g = attention_block_backward(*(_bf16_cast(a, F32) for a in (q, k, v, o)), lse, _bf16_cast(dout, F32),
                                     scale, causal)
        return tuple(_bf16_cast(x, q.dtype) for x in g)
    if not _native_block(q, k, v, o, lse, dout):
        return reference.attention_block_backward(q, k, v, o, lse, dout, scale, causal)
    if o.size != B * Tq * H * D or dout.size != o.size or lse.size != B * H * Tq:
        raise ValueError(f"attention_block_backward: o {o.shape}, dout {dout.shape}, lse {lse.shape} do not match "
                         f"q {q.shape}: expected (B, Tq, H*D) twice and (B, H, Tq)")
    dq, dk, dv = out if out is not None else (np.empty((B, n, H, D), dtype=q.dtype) for n in (Tq, Tk, Tk))
    o4, dout4 = (_in_place(a.reshape(B, Tq, H, D)) for a in (o, dout))   # a head group's columns: read in place
    _C.attention_block_backward(_in_place(q), _in_place(k), _in_place(v), o4, _c(lse), dout4, dq, dk, dv,
                                float(scale), bool(causal))
    if Tq == 0:                                  # no query sees these keys: their gradients are 0
        dk[...] = 0
        dv[...] = 0
    return dq, dk, dv


# --- layernorm -----------------------------------------------------------------------------
def _ln_params_ok(x, w, b):
    return x.ndim >= 1 and w.shape == x.shape[-1:] and b.shape == w.shape


def _stats(x):
    return np.empty(x.shape[:-1], dtype=F32), np.empty(x.shape[:-1], dtype=F32)


def layernorm_forward(x, w, b, eps=1e-5):
    if _bf(x) and _f32(w, b) and _ln_params_ok(x, w, b):
        x = _c(x)
        y, (mean, rstd) = np.empty_like(x), _stats(x)
        _C.layernorm_forward_bf16(x, _c(w), _c(b), y, mean, rstd, float(eps))
        return y, mean, rstd
    dt = x.dtype
    if dt not in _FLOATS or w.dtype != dt or b.dtype != dt or x.ndim < 1 or w.shape != x.shape[-1:] \
            or b.shape != w.shape:
        return reference.layernorm_forward(x, w, b, eps)
    x, w, b = _c(x), _c(w), _c(b)
    y, mean, rstd = _layernorm_outputs(x)
    _C.layernorm_forward(x, w, b, y, mean, rstd, float(eps))
    return y, mean, rstd


def _layernorm_outputs(x):
    """y (like x), mean and rstd (x's leading shape) for a layernorm kernel to write."""
    return np.empty_like(x), np.empty(x.shape[:-1], dtype=x.dtype), np.empty(x.shape[:-1], dtype=x.dtype)


def add_layernorm_forward(x, res, w, b, eps=1e-5):
    if _inplace_ok(x, _BF16) and _bf(res) and res.shape == x.shape and _f32(w, b) and _ln_params_ok(x, w, b):
        y, (mean, rstd) = np.empty_like(x), _stats(x)
        _C.add_layernorm_forward_bf16(x, _c(res), _c(w), _c(b), y, mean, rstd, float(eps))
        return y, mean, rstd
    dt = x.dtype
    if not _inplace_ok(x, _FLOATS) or res.dtype != dt or res.shape != x.shape or w.dtype != dt \
            or b.dtype != dt or x.ndim < 1 or w.shape != x.shape[-1:] or b.shape != w.shape:
        x += res                                 # unfused: the add, then layernorm_forward's own
        return layernorm_forward(x, w, b, eps)   # choice (native, or the reference for what it cannot take)
    res, w, b = _c(res), _c(w), _c(b)
    y, mean, rstd = _layernorm_outputs(x)
    _C.add_layernorm_forward(x, res, w, b, y, mean, rstd, float(eps))
    return y, mean, rstd


def layernorm_backward(dy, x, w, mean, rstd, residual=None):
    if (_bf(dy, x) and _f32(w, mean, rstd) and dy.shape == x.shape and x.ndim >= 1 and w.shape == x.shape[-1:]
            and mean.shape == x.shape[:-1] and rstd.shape == mean.shape
            and (residual is None or (_bf(residual) and residual.shape == x.shape))):
        dy, x = _c(dy), _c(x)
        dx, dw, db = np.empty_like(x), np.empty(w.shape, F32), np.empty(w.shape, F32)
        _C.layernorm_backward_bf16(dy, x, _c(w), _c(mean), _c(rstd), dx, dw, db,
                                   None if residual is None else _c(residual))
        return dx, dw, db
    dt = x.dtype
    if dt not in _FLOATS or any(a.dtype != dt for a in (dy, w, mean, rstd)) or dy.shape != x.shape \
            or x.ndim < 1 or w.shape != x.shape[-1:] or mean.shape != x.shape[:-1] or rstd.shape != mean.shape \
            or (residual is not None and (residual.dtype != dt or residual.shape != x.shape)):
        return reference.layernorm_backward(dy, x, w, mean, rstd, residual)
    dy, x, w, mean, rstd = _c(dy), _c(x), _c(w), _c(mean), _c(rstd)
    dx = np.empty_like(x)
    dw = np.empty_like(w)
    db = np.empty_like(w)
    _C.layernorm_backward(dy, x, w, mean, rstd, dx, dw, db, None if residual is None else _c(residual))
    return dx, dw, db


# --- GELU ----------------------------------------------------------------------------------
def gelu_forward(x):
    if _bf(x):
        x = _c(x)
        y = np.empty_like(x)
        _C.gelu_forward_bf16(x, y)
        return y
    if x.dtype not in _FLOATS:
        return reference.gelu_forward(x)
    x = _c(x)
    y = np.empty_like(x)
    _C.gelu_forward(x, y)
    return y


def bias_gelu_forward(h, b):
    if _inplace_ok(h, _BF16) and _f32(b) and h.ndim >= 1 and b.shape == h.shape[-1:]:
        y = np.empty_like(h)
        _C.bias_gelu_forward_bf16(h, _c(b), y)
        return y
    if not _inplace_ok(h, _FLOATS) or b.dtype != h.dtype or h.ndim < 1 or b.shape != h.shape[-1:]:
        h += b                                   # unfused: the add, then gelu_forward's own choice
        return gelu_forward(h)
    y = np.empty_like(h)
    _C.bias_gelu_forward(h, _c(b), y)
    return y


def bias_add(y, b):
    if _inplace_ok(y, _BF16) and _f32(b) and y.ndim >= 1 and b.shape == y.shape[-1:]:
        _C.bias_add_bf16(y, _c(b))
        return y
    if not (_inplace_ok(y, _FLOATS) and y.ndim >= 1 and isinstance(b, np.ndarray) and b.dtype == y.dtype
            and b.shape == y.shape[-1:]):
        return reference.bias_add(y, b)
    _C.bias_add(y, _c(b))
    return y


def column_sum(x, dtype=None, out=None):
    dt = np.dtype(dtype) if dtype is not None else x.dtype
    if (_bf(x) and x.ndim == 2 and dt == F32 and x.flags.c_contiguous
            and (out is None or (_inplace_ok(out, _F32ONLY) and out.shape == x.shape[1:]))):
        o = np.empty(x.shape[1], dtype=F32) if out is None else out
        _C.column_sum_bf16(x, o)
        return o
    if not (isinstance(x, np.ndarray) and x.ndim == 2 and x.dtype in _FLOATS and dt == x.dtype
            and x.flags.c_contiguous and (out is None or (_inplace_ok(out, (dt,)) and out.shape == x.shape[1:]))):
        return reference.column_sum(x, dtype, out)
    o = np.empty(x.shape[1], dtype=dt) if out is None else out
    _C.column_sum(x, o)
    return o


def scatter_add(dst, idx, src):
    r = _rows(idx, dst.shape[0]) if isinstance(src, np.ndarray) and src.ndim == 2 else None
    if (r is None or r.shape[0] != src.shape[0] or not _inplace_ok(dst, (F32, F64)) or dst.ndim != 2
            or src.dtype != dst.dtype or src.shape[1] != dst.shape[1]):
        return reference.scatter_add(dst, idx, src)
    _C.scatter_add(dst, r, _c(src))   # each dst row's additions in the order of i, as np.add.at; no rows: dst as it was
    return dst


def gelu_backward(x, dy, out=None):
    if _bf(x, dy) and dy.shape == x.shape and (out is None or (_inplace_ok(out, _BF16) and out.shape == x.shape)):
        x, dy = _c(x), _c(dy)
        dx = np.empty_like(x) if out is None else out
        _C.gelu_backward_bf16(x, dy, dx)
        return dx
    if (x.dtype not in _FLOATS or dy.dtype != x.dtype or dy.shape != x.shape
            or (out is not None and not (_inplace_ok(out, (x.dtype,)) and out.shape == x.shape))):
        return reference.gelu_backward(x, dy, out)
    x, dy = _c(x), _c(dy)
    dx = np.empty_like(x) if out is None else out    # elementwise: out may be dy or x itself
    _C.gelu_backward(x, dy, dx)
    return dx


# --- fused softmax + cross-entropy ---------------------------------------------------------
def cross_entropy_forward(logits, targets):
    if logits.dtype not in _FLOATS or logits.ndim != 2:
        return reference.cross_entropy_forward(logits, targets)
    logits, t = _c(logits), _i64(targets)
    if t.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy_forward: targets shape {t.shape} must be ({logits.shape[0]},)")
    loss = np.empty(logits.shape[0], dtype=logits.dtype)
    lse = np.empty_like(loss)
    _C.cross_entropy_forward(logits, t, loss, lse)
    return loss, lse


def cross_entropy_backward(logits, lse, targets, dloss, out=None):
    dt = logits.dtype
    d = np.asarray(dloss, dtype=dt)
    if (dt not in _FLOATS or logits.ndim != 2 or lse.dtype != dt or d.ndim > 1
            or (out is not None and not (_inplace_ok(out, (dt,)) and out.shape == logits.shape))):
        return reference.cross_entropy_backward(logits, lse, targets, dloss, out)
    logits, lse, t, d = _c(logits), _c(lse), _i64(targets), _c(d).reshape(-1)
    dlogits = np.empty_like(logits) if out is None else out
    _C.cross_entropy_backward(logits, lse, t, d, dlogits)
    return dlogits


# --- AdamW ---------------------------------------------------------------------------------
def adamw_step(p, g, m, v, *, lr, beta1, beta2, eps, weight_decay, step):
    mdt = (p.dtype,) if m.dtype == p.dtype else (_BF16 if p.dtype == F32 else ())   # bf16 moments: float32 p
    ok = (_inplace_ok(p, _FLOATS) and _inplace_ok(m, mdt) and _inplace_ok(v, mdt) and v.dtype == m.dtype
          and isinstance(g, np.ndarray) and g.shape == p.shape == m.shape == v.shape
          and (g.dtype in _CASTABLE if p.dtype == F32 else g.dtype == F64))
    if not ok:
        return reference.adamw_step(p, g, m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                    weight_decay=weight_decay, step=step)
    bc1 = 1 - beta1 ** step
    bc2 = 1 - beta2 ** step
    _C.adamw_step(p, _c(g), m, v, float(lr), float(beta1), float(beta2), float(eps),
                  float(weight_decay), float(bc1), float(bc2))


# --- MoE routing helpers -------------------------------------------------------------------
def topk(scores, k):
    if scores.dtype not in _FLOATS or scores.ndim != 2 or not 1 <= k <= scores.shape[1]:
        return reference.topk(scores, k)
    scores = _c(scores)
    idx = np.empty((scores.shape[0], k), dtype=np.int64)
    vals = np.empty((scores.shape[0], k), dtype=scores.dtype)
    _C.topk(scores, int(k), idx, vals)
    return idx, vals


def capacity_positions(expert_idx, n_expert, capacity):
    e = _i64(expert_idx).reshape(-1)
    pos = np.empty(e.shape[0], dtype=np.int64)
    counts = np.empty(int(n_expert), dtype=np.int64)
    _C.capacity_positions(e, int(n_expert), int(capacity), pos, counts)
    return pos, counts


def _rows(rows, n):
    r = np.asarray(rows)
    if r.ndim != 1 or r.dtype.kind not in "iu":
        return None  # masks, nested indices: the reference (NumPy indexing) decides
    r = _i64(r)
    if r.size and r.min() < 0:
        r = np.where(r < 0, r + n, r)  # NumPy's negative indices
    return r


def permute(x, rows):
    r = _rows(rows, x.shape[0]) if isinstance(x, np.ndarray) and x.ndim >= 1 else None
    if r is None:
        return reference.permute(x, rows)
    x = _c(x)
    out = np.empty((r.shape[0],) + x.shape[1:], dtype=x.dtype)
    _C.permute(x, r, out)
    return out


def unpermute_add(y, rows, weights, n_rows):
    r = _rows(rows, n_rows) if (y.dtype in _FLOATS or _bf(y)) and y.ndim == 2 else None
    if r is None or r.shape[0] != y.shape[0]:
        return reference.unpermute_add(y, rows, weights, n_rows)
    y = _c(y)
    w = None if weights is None else np.ascontiguousarray(weights, dtype=y.dtype).reshape(-1)
    out = np.zeros((int(n_rows), y.shape[1]), dtype=y.dtype)
    _C.unpermute_add(y, r, w, out)
    return out


# --- casts and elementwise reductions ------------------------------------------------------
def cast(x, dtype):
    dt = np.dtype(dtype)
    if (not isinstance(x, np.ndarray) or x.dtype not in _CASTABLE or dt not in _CASTABLE
            or not x.flags.c_contiguous or (x.dtype == F64 and dt in _HALVES)):
        return reference.cast(x, dtype)
    out = np.empty(x.shape, dtype=dt)
    _C.cast(x, out)
    return out


def reduce_inplace(dst, src, op="sum"):
    if op not in _OPS:
        raise ValueError(f"unknown reduction op {op!r}: expected sum, max, min or prod")
    if not (_inplace_ok(dst, _REDUCIBLE) and isinstance(src, np.ndarray) and src.dtype == dst.dtype
            and src.shape == dst.shape):
        return reference.reduce_inplace(dst, src, op)
    _C.reduce_inplace(dst, _c(src), _OPS[op])
    return dst


def scale_inplace(x, alpha):
    a = np.asarray(alpha)
    if not (_inplace_ok(x, _REDUCIBLE) and a.ndim == 0 and a.dtype.kind in "iuf"):
        return reference.scale_inplace(x, alpha)
    _C.scale_inplace(x, float(a))
    return x


def exact_add(x, top, bins):
    if (not isinstance(x, np.ndarray) or x.dtype not in (np.float32, np.float64) or not x.flags.c_contiguous
            or not top.flags.c_contiguous or not bins.flags.c_contiguous):
        return reference.exact_add(x, top, bins)
    return int(_C.exact_add(x, top, bins, bins.shape[1]))


def exact_raise(top, bins, new_top):
    _C.exact_raise(top, bins, np.ascontiguousarray(new_top, np.int32))


def exact_value(top, bins, out):
    _C.exact_value(top, bins, out, int(reference.EXACT_NONE), int(reference.EXACT_BAD))
