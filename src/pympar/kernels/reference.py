"""Pure-xp reference kernels: the definition every native (C++/CUDA) kernel is tested against.

Conventions (shared by every backend):
- the last axis is the reduced axis; leading axes are flattened by the callers' shapes;
- low-precision inputs (float16, bfloat16) are computed in float32 and returned in the input dtype;
- statistics (layernorm mean/rstd, cross-entropy logsumexp, per-row loss) are float32
  (float64 when the input is float64);
- backward kernels return gradients; callers accumulate parameter gradients themselves.
"""
from __future__ import annotations

import math

import numpy as np

from ..backend import xp_of

GELU_C = math.sqrt(2.0 / math.pi)


def _acc_dtype(dt):
    return np.float64 if np.dtype(dt) == np.float64 else np.float32


def _up(x):
    return x.astype(_acc_dtype(x.dtype), copy=False)


def _add_into(x, y):
    """x += y in place, a low-precision x computed in float32 and rounded once (y of any float dtype:
    a float32 bias or a bf16 residual); returns x."""
    if x.dtype.itemsize == 2:
        x[...] = (_up(x) + _up(y)).astype(x.dtype)
    else:
        x += y
    return x


# --- causal softmax -------------------------------------------------------------------
def softmax_causal_forward(x, out=None):
    """x (..., T, T) attention scores (already scaled) -> probabilities, row i sees columns <= i.

    Masked entries of the output are exactly 0 whatever the input holds there. ``out``: an
    array of x's shape and dtype to write the probabilities into (returned).
    """
    xp = xp_of(x)
    T = x.shape[-1]
    xf = _up(x)
    mask = xp.triu(xp.ones((T, T), dtype=bool), k=1)
    xf = xp.where(mask, -xp.inf, xf)
    xf = xf - xf.max(axis=-1, keepdims=True)
    e = xp.exp(xf)
    y = e / e.sum(axis=-1, keepdims=True)
    if out is not None:
        out[...] = y
        return out
    return y.astype(x.dtype, copy=False)


def softmax_causal_backward(y, dy):
    """y = softmax_causal_forward(x), dy (..., T, T) -> dx = y * (dy - sum(dy * y))."""
    yf, dyf = _up(y), _up(dy)
    dx = yf * (dyf - (dyf * yf).sum(axis=-1, keepdims=True))
    return dx.astype(y.dtype, copy=False)


# --- attention of one block (the memory-efficient kernels' definition) -----------------
def _block_dims(fn, q, k, v, causal):
    """(B, Tq, Tk, H, D) of q (B, Tq, H, D) against k, v (B, Tk, H, D); a ValueError names what is wrong."""
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(f"{fn}: q {q.shape}, k {k.shape}, v {v.shape} must be (B, Tq, H, D), (B, Tk, H, D) "
                         f"and (B, Tk, H, D)")
    B, Tq, H, D = q.shape
    Tk = k.shape[1]
    if causal and Tq != Tk:
        raise ValueError(f"{fn}: causal needs Tq == Tk, got Tq={Tq} Tk={Tk}")
    return B, Tq, Tk, H, D


def _block_scores(q, k, scale, causal):
    """-> qs (scaled), k (B, H, T, D) and the scores qs k^T (B, H, Tq, Tk), -inf where the causal
    mask hides a key (so that exp(scores - lse) is exactly 0 there)."""
    xp = xp_of(q)
    qs, k = (_up(a).transpose(0, 2, 1, 3) for a in (q, k))
    qs = qs * qs.dtype.type(scale)
    s = qs @ k.transpose(0, 1, 3, 2)
    if causal:
        s = xp.where(xp.triu(xp.ones(s.shape[-2:], dtype=bool), k=1), -xp.inf, s)
    return qs, k, s


def attention_block_forward(q, k, v, scale, causal):
    """One block of (ring) attention: q (B, Tq, H, D) against k, v (B, Tk, H, D) -> (o (B, Tq, H*D),
    lse (B, H, Tq)), o in q's dtype, lse the row log-sum-exp of the scaled scores (statistics dtype).

    causal: query t sees keys <= t (needs Tq == Tk); otherwise every query sees every key. This
    twin materialises (B, H, Tq, Tk); the native kernel computes the same numbers tile by tile."""
    B, Tq, _, H, D = _block_dims("attention_block_forward", q, k, v, causal)
    xp = xp_of(q)
    _, _, s = _block_scores(q, k, scale, causal)
    m = s.max(axis=-1, keepdims=True)
    e = xp.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    o = (e / l) @ _up(v).transpose(0, 2, 1, 3)                 # (B, H, Tq, D)
    o = xp.ascontiguousarray(o.transpose(0, 2, 1, 3).reshape(B, Tq, H * D), dtype=q.dtype)
    return o, (m + xp.log(l))[..., 0]


def _check_block_out(out, B, Tq, Tk, H, D, dtype, inputs=None):
    """out of attention_block_backward: three arrays (dq, dk, dv) of shapes (B, Tq|Tk|Tk, H, D),
    sharing no element with each other or with ``inputs`` (NumPy arrays: the kernel writes dq while it
    still reads q, k, v, o and dout, and each of dq, dk, dv once)."""
    want = [(B, Tq, H, D), (B, Tk, H, D), (B, Tk, H, D)]
    shapes = [tuple(getattr(a, "shape", ())) for a in out]
    if len(out) != 3 or shapes != want:
        raise ValueError(f"attention_block_backward: out has shapes {shapes}, expected {want} (dq, dk, dv)")
    if any(a.dtype != dtype for a in out):
        raise ValueError(f"attention_block_backward: out has dtypes {[str(a.dtype) for a in out]}, expected "
                         f"{dtype}, q's")
    names = ("dq", "dk", "dv")
    for i, a in enumerate(out):
        if not isinstance(a, np.ndarray):
            continue
        others = [(names[j], out[j]) for j in range(i + 1, 3)] + list((inputs or {}).items())
        for name, b in others:
            if isinstance(b, np.ndarray) and np.shares_memory(a, b):
                raise ValueError(f"attention_block_backward: out's {names[i]} shares memory with {name}; "
                                 f"out must not overlap itself or the inputs")


def attention_block_backward(q, k, v, o, lse, dout, scale, causal, out=None):
    """d(attention_block_forward) -> (dq (B, Tq, H, D), dk, dv (B, Tk, H, D)), dout (B, Tq, H*D).
    out: (dq, dk, dv) arrays (strided views allowed; a ValueError where they overlap each other or
    the inputs) the gradients are written to (=) and that are returned.

    o and lse are those of the complete softmax of these query rows over every key block (ring
    attention's merged result): P = exp(S - lse), dS = P * (dP - rowsum(dout * o)). With the block's
    own o, lse this is the ordinary attention backward; summed over a partition of the keys, dq
    (and each key block's dk, dv) are the full attention's."""
    B, Tq, Tk, H, D = _block_dims("attention_block_backward", q, k, v, causal)
    if out is not None:
        _check_block_out(out, B, Tq, Tk, H, D, q.dtype, dict(q=q, k=k, v=v, o=o, lse=lse, dout=dout))
    xp = xp_of(q)
    qs, kh, s = _block_scores(q, k, scale, causal)
    p = xp.exp(s - _up(lse)[..., None])
    do = _up(dout).reshape(B, Tq, H, D).transpose(0, 2, 1, 3)  # (B, H, Tq, D)
    row = (do * _up(o).reshape(B, Tq, H, D).transpose(0, 2, 1, 3)).sum(axis=-1, keepdims=True)
    dp = do @ _up(v).transpose(0, 2, 3, 1)
    ds = p * (dp - row)
    dq = (ds @ kh) * qs.dtype.type(scale)
    dk = ds.transpose(0, 1, 3, 2) @ qs
    dv = p.transpose(0, 1, 3, 2) @ do
    got = tuple(xp.ascontiguousarray(g.transpose(0, 2, 1, 3), dtype=q.dtype) for g in (dq, dk, dv))
    return got if out is None else _write_out(out, got)


def _write_out(out, got):
    """The gradients ``got`` written into ``out`` (=), which is returned."""
    for dst, g in zip(out, got):
        dst[...] = g
    return tuple(out)


def attention_forward(qkv, scale):
    """qkv (B, T, 3, H, D), packed as nn.attention_core reads it -> (o (B, T, H*D), lse (B, H, T)):
    the causal block of q = qkv[:, :, 0], k = qkv[:, :, 1], v = qkv[:, :, 2]."""
    return attention_block_forward(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], scale, True)


def attention_backward(qkv, o, lse, dout, scale, overwrite=False):
    """d(attention_forward) -> dqkv (B, T, 3, H, D), given o, lse from the forward and dout (B, T, H*D).
    overwrite=True permits (does not require) writing dqkv over qkv, which the caller will not read
    again: the C++ kernel does (no second 3C per token beside qkv); this one and CUDA's do not."""
    g = attention_block_backward(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], o, lse, dout, scale, True)
    return xp_of(qkv).stack(g, axis=2)


# --- layernorm ------------------------------------------------------------------------
def layernorm_forward(x, w, b, eps=1e-5):
    """x (..., C), w (C,), b (C,) -> (y (..., C), mean (...), rstd (...))."""
    xf = _up(x)
    mean = xf.mean(axis=-1)
    xc = xf - mean[..., None]
    var = (xc * xc).mean(axis=-1)
    rstd = 1.0 / (var + eps) ** 0.5
    y = xc * rstd[..., None] * _up(w) + _up(b)
    return y.astype(x.dtype, copy=False), mean, rstd


def add_layernorm_forward(x, res, w, b, eps=1e-5):
    """x += res (in place: the residual sum, which the caller keeps), then layernorm_forward(x, w,
    b, eps): -> (y, mean, rstd). One pass where the two make two (the fused kernels)."""
    return layernorm_forward(_add_into(x, res), w, b, eps)


def layernorm_backward(dy, x, w, mean, rstd, residual=None):
    """-> (dx (..., C), dw (C,), db (C,)); dw/db in the accumulation dtype. residual (optional, the
    shape of x): added to dx (the gradient that reaches x by the residual path too), after dx is
    rounded to x's dtype, as an add after the call would."""
    xf, dyf, wf = _up(x), _up(dy), _up(w)
    C = x.shape[-1]
    xhat = (xf - mean[..., None]) * rstd[..., None]
    dxhat = dyf * wf
    dw = (dyf * xhat).reshape(-1, C).sum(axis=0)
    db = dyf.reshape(-1, C).sum(axis=0)
    dx = rstd[..., None] * (dxhat - dxhat.mean(axis=-1, keepdims=True)
                            - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    dx = dx.astype(x.dtype, copy=False)
    if residual is not None:
        _add_into(dx, residual)
    return dx, dw, db


# --- GELU, tanh form ------------------------------------------------------------------
def gelu_forward(x):
    xp = xp_of(x)
    xf = _up(x)
    y = 0.5 * xf * (1.0 + xp.tanh(GELU_C * (xf + 0.044715 * (xf * xf * xf))))
    return y.astype(x.dtype, copy=False)


def bias_gelu_forward(h, b):
    """h += b (in place: the GEMM's output gets its bias, and the caller keeps it), then
    gelu_forward(h). One pass where the two make two (the fused kernels). A bf16 h takes a float32
    b: h = round(h + b), then GELU of the rounded h."""
    return gelu_forward(_add_into(h, b))


def bias_add(y, b):
    """y += b in place (y (..., F), b (F,): a GEMM's bias; a bf16 y takes a float32 b, rounded once);
    returns y."""
    return _add_into(y, b)


def column_sum(x, dtype=None, out=None):
    """The sum of x's rows (x (N, F) -> (F,)), in ``dtype`` (default x's), written into ``out``
    when given: x.sum(axis=0), which NumPy adds row after row in order."""
    return x.sum(axis=0, dtype=dtype or x.dtype, out=out)


def scatter_add(dst, idx, src):
    """dst[idx[i]] += src[i] for i in order, repeated indices accumulated (dst (V, C), idx (M,),
    src (M, C)), in place; returns dst."""
    from ..backend import scatter_add as _scatter

    return _scatter(dst, idx, src)


def gelu_backward(x, dy, out=None):
    """dx = GELU'(x) * dy; out (optional; may be dy or x itself): where dx is written."""
    xp = xp_of(x)
    xf, dyf = _up(x), _up(dy)
    u = GELU_C * (xf + 0.044715 * (xf * xf * xf))
    t = xp.tanh(u)
    du = GELU_C * (1.0 + 3 * 0.044715 * xf * xf)
    g = 0.5 * (1.0 + t) + 0.5 * xf * (1.0 - t * t) * du
    if out is not None:
        out[...] = g * dyf
        return out
    return (g * dyf).astype(x.dtype, copy=False)


# --- fused softmax + cross-entropy ----------------------------------------------------
def cross_entropy_forward(logits, targets):
    """logits (N, V), targets (N,) int -> (loss (N,), lse (N,)); a target < 0 is ignored (loss 0)."""
    xp = xp_of(logits)
    lf = _up(logits)
    m = lf.max(axis=-1)
    lse = m + xp.log(xp.exp(lf - m[:, None]).sum(axis=-1))
    t = xp.asarray(targets).astype(np.int64)
    valid = t >= 0
    picked = xp.take_along_axis(lf, xp.where(valid, t, 0)[:, None], axis=-1)[:, 0]
    loss = xp.where(valid, lse - picked, 0.0).astype(lse.dtype)
    return loss, lse


def cross_entropy_backward(logits, lse, targets, dloss, out=None):
    """dlogits = (softmax(logits) - onehot(targets)) * dloss[:, None]; ignored rows get 0.

    dloss is a scalar or (N,). out (optional; may be logits itself): where dlogits is written."""
    xp = xp_of(logits)
    lf = _up(logits)
    p = xp.exp(lf - lse[:, None])
    t = xp.asarray(targets).astype(np.int64)
    valid = t >= 0
    rows = xp.arange(lf.shape[0])
    p[rows[valid], t[valid]] -= 1.0
    d = xp.asarray(dloss, dtype=p.dtype)
    d = d[:, None] if d.ndim == 1 else d
    p = p * d * valid[:, None]
    if out is not None:
        out[...] = p
        return out
    return p.astype(logits.dtype, copy=False)


# --- AdamW ----------------------------------------------------------------------------
def adamw_step(p, g, m, v, *, lr, beta1, beta2, eps, weight_decay, step):
    """In place on p, m, v (float32 or float64); g in any float dtype. step counts from 1. m and v may
    be bfloat16 beside float32 p (bf16 optimizer state): updated in float32, the step taken from those
    float32 values, and stored rounded once."""
    gf = g.astype(p.dtype, copy=False)
    low = m.dtype != p.dtype
    mf = m.astype(p.dtype) if low else m
    vf = v.astype(p.dtype) if low else v
    mf *= beta1
    mf += (1 - beta1) * gf
    vf *= beta2
    vf += (1 - beta2) * gf * gf
    bc1 = 1 - beta1 ** step
    bc2 = 1 - beta2 ** step
    if weight_decay:
        p *= 1 - lr * weight_decay
    p -= lr * (mf / bc1) / ((vf / bc2) ** 0.5 + eps)
    if low:
        m[...] = mf.astype(m.dtype)
        v[...] = vf.astype(v.dtype)


# --- MoE routing helpers --------------------------------------------------------------
def topk(scores, k):
    """scores (N, E) -> (idx (N, k) int64, vals (N, k)) sorted descending; ties pick the lower index."""
    xp = xp_of(scores)
    # stable argsort of -scores keeps lower indices first among equal values
    idx = xp.argsort(-scores, axis=-1, kind="stable")[:, :k].astype(np.int64)
    vals = xp.take_along_axis(scores, idx, axis=-1)
    return idx, vals


def capacity_positions(expert_idx, n_expert, capacity):
    """expert_idx (A,) int: the expert of each assignment, in priority order.

    -> (pos (A,) int64: slot of the assignment inside its expert, -1 when beyond capacity;
        counts (n_expert,) int64: assignments per expert before dropping).
    capacity <= 0 means unlimited (dropless)."""
    xp = xp_of(expert_idx)
    e = xp.asarray(expert_idx).astype(np.int64)
    A = e.shape[0]
    onehot = xp.zeros((A, n_expert), dtype=np.int64)
    if A:
        onehot[xp.arange(A), e] = 1
    rank = xp.cumsum(onehot, axis=0) - onehot
    pos = rank[xp.arange(A), e] if A else xp.zeros(0, dtype=np.int64)
    counts = onehot.sum(axis=0)
    if capacity > 0:
        pos = xp.where(pos < capacity, pos, -1)
    return pos.astype(np.int64), counts.astype(np.int64)


def permute(x, rows):
    """Gather rows: x (N, C), rows (M,) int -> (M, C)."""
    return x[rows]


def unpermute_add(y, rows, weights, n_rows):
    """Scatter-add: out (n_rows, C) with out[rows[i]] += weights[i] * y[i] (weights None = 1)."""
    xp = xp_of(y)
    out = xp.zeros((n_rows, y.shape[1]), dtype=y.dtype)
    src = y if weights is None else y * weights[:, None].astype(y.dtype)
    if xp is np:
        np.add.at(out, rows, src)
    else:  # cupy
        xp.add.at(out, rows, src)
    return out


# --- casts and elementwise reductions (used by the communicators) ---------------------
def cast(x, dtype):
    return x.astype(dtype)


def reduce_inplace(dst, src, op="sum"):
    """dst = op(dst, src) elementwise, in place; op in sum | max | min | prod."""
    xp = xp_of(dst)
    if op == "sum":
        dst += src
    elif op == "max":
        xp.maximum(dst, src, out=dst)
    elif op == "min":
        xp.minimum(dst, src, out=dst)
    elif op == "prod":
        dst *= src
    else:
        raise ValueError(f"unknown reduction op {op!r}: expected sum, max, min or prod")
    return dst


def scale_inplace(x, alpha):
    x *= x.dtype.type(alpha)            # a scalar of x's dtype (CuPy takes no 0-d NumPy array here)
    return x


# --- reproducible sums (pympar/comm/exact.py) ------------------------------------------------------
EXACT_BIN = 32
EXACT_NONE = np.iinfo(np.int32).min // 2         # an element no term has reached
EXACT_BAD = np.iinfo(np.int32).max // 2          # an element a non-finite term reached: its sum is NaN


def _exact_parts(x):
    """(m, e) integer pairs with x = sum(m * 2^e), |m| < 2^27: one for float32, two for float64."""
    digits = 24 if x.dtype == np.float32 else 53
    f, E = np.frexp(x)
    m = (f.astype(np.float64) * float(1 << digits)).astype(np.int64)    # exact: |f| < 1 has `digits` bits
    e = E.astype(np.int64) - digits
    if digits == 24:
        return [(m, e)]
    a, s = np.abs(m), np.sign(m)
    return [(s * (a >> 26), e + 26), (s * (a & ((1 << 26) - 1)), e)]


def exact_raise(top, bins, new_top):
    """Move each element's window of bins up to new_top (>= top), dropping the bins that leave it."""
    K = bins.shape[1]
    shift = (new_top.astype(np.int64) - top).clip(0, K)
    if (shift > 0).any():
        padded = np.concatenate([np.zeros_like(bins), bins], axis=1)
        bins[...] = np.take_along_axis(padded, np.arange(K)[None, :] + (K - shift)[:, None], axis=1)
        top[...] = np.maximum(top, new_top)


def exact_add(x, top, bins):
    """Add the terms x (n,) float32 or float64 into the integer bins (n, K) whose highest bin index
    is top (n,) int32, in place (ExactSum.add). Returns the index of the first non-finite term (then
    nothing was added), else -1."""
    bad = np.flatnonzero(~np.isfinite(x))
    if bad.size:
        return int(bad[0])
    pieces = []
    for m, e in _exact_parts(x):
        lo_bin = np.floor_divide(e, EXACT_BIN)
        v = np.abs(m) << (e - lo_bin * EXACT_BIN)        # < 2^59: the part's bits from bin lo_bin up
        s = np.sign(m)
        pieces.append((lo_bin, s * (v & ((1 << EXACT_BIN) - 1)), s * (v >> EXACT_BIN)))
    term_top = np.full(len(x), EXACT_NONE, np.int64)
    for lo_bin, lo, hi in pieces:
        term_top = np.maximum(term_top, np.where(hi != 0, lo_bin + 1, np.where(lo != 0, lo_bin, EXACT_NONE)))
    exact_raise(top, bins, np.maximum(top, term_top))
    rows = np.arange(len(x))
    K = bins.shape[1]
    for lo_bin, lo, hi in pieces:
        for b, val in ((lo_bin + 1, hi), (lo_bin, lo)):
            k = top.astype(np.int64) - b                  # the window's index of bin b
            ok = (val != 0) & (k >= 0) & (k < K)
            bins[rows[ok], k[ok]] += val[ok]              # one (row, bin) pair per element here
    return -1


def exact_value(top, bins, out):
    """ExactSum.value: the bins read into out (n,) float64 (the bins are not changed): a copy is
    normalised (every bin but the top one in [0, 2^32), the integer unchanged), then Neumaier's
    compensated sum of each bin's exact value relative to the top bin, scaled by 2^(32 top) once.
    NaN where a non-finite term was added (top == EXACT_BAD), 0 where none was."""
    K = bins.shape[1]
    b = bins.copy()
    for k in range(K - 1, 0, -1):
        carry = b[:, k] >> EXACT_BIN                     # floor division: the remainder is >= 0
        b[:, k] -= carry << EXACT_BIN
        b[:, k - 1] += carry
    s, c = np.zeros(len(top)), np.zeros(len(top))
    for k in range(K):
        v = np.ldexp(b[:, k].astype(np.float64), -k * EXACT_BIN)
        u = s + v
        c += np.where(np.abs(s) >= np.abs(v), (s - u) + v, (v - u) + s)
        s = u
    live = (top != EXACT_NONE) & (top != EXACT_BAD)
    e = np.where(live, top.astype(np.int64) * EXACT_BIN, 0)
    with np.errstate(over="ignore"):
        r = np.ldexp(s + c, np.clip(e, -3000, 3000))
    out[...] = np.where(top == EXACT_BAD, np.nan, np.where(live, r, 0.0))
