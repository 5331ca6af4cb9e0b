"""Each CUDA kernel (pympar._cuda through pympar.kernels.cuda) against the NumPy reference.

Marked `gpu`: skipped unless CuPy, a visible GPU and the built pympar._cuda are all present.
float32 and float16 always; bfloat16 when this CuPy can hold bfloat16 arrays.
"""
from __future__ import annotations

import numpy as np
import pytest

from pympar import backend
from pympar.kernels import reference as R

cp = backend.cupy_or_none()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cp is None, reason="needs CuPy and a visible GPU")]
if cp is not None:
    try:
        from pympar.kernels import cuda as G
    except ImportError:
        pytestmark.append(pytest.mark.skip(reason="pympar._cuda is not built"))


def _dtypes():
    out = [np.dtype(np.float32), np.dtype(np.float16)]
    if cp is not None and backend.bfloat16 is not None:
        try:
            cp.zeros(1, dtype=backend.bfloat16)
            out.append(backend.bfloat16)
        except Exception:
            pass
    return out


DTYPES = _dtypes()
TOL = {"float32": dict(rtol=1e-4, atol=1e-5), "float16": dict(rtol=1e-2, atol=2e-3),
       "bfloat16": dict(rtol=3e-2, atol=2e-2)}


def host(a):
    return cp.asnumpy(a) if isinstance(a, cp.ndarray) else a


def close(got, want, dt):
    got, want = np.asarray(host(got), np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, **TOL[backend.dtype_name(dt)])


def data(rng, shape, dt, scale=1.0):
    """the same values on host (rounded to dt) and device"""
    h = (rng.standard_normal(shape) * scale).astype(np.float32).astype(dt)
    return h, cp.asarray(h)


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
def test_softmax_causal(dt):
    rng = np.random.default_rng(0)
    h, d = data(rng, (3, 37, 37), dt, 2.0)
    y = G.softmax_causal_forward(d)
    close(y, R.softmax_causal_forward(h.astype(np.float32)), dt)
    gh, gd = data(rng, h.shape, dt)
    yh = host(y)
    close(G.softmax_causal_backward(y, gd), R.softmax_causal_backward(yh.astype(np.float32), gh.astype(np.float32)), dt)
    # out=: written in place (a contiguous slice, as attention passes) and through a strided view
    full = cp.zeros((5,) + h.shape[1:], dtype=d.dtype)
    r = G.softmax_causal_forward(d, out=full[1:4])
    assert r.data.ptr == full[1:4].data.ptr and (full[1:4] == y).all() and not full[0].any() and not full[4].any()
    t = cp.zeros(h.shape[::-1], dtype=d.dtype).transpose(2, 1, 0)          # same shape, not contiguous
    assert (G.softmax_causal_forward(d, out=t) == y).all()


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(1, 1, 1, 4), (2, 70, 3, 32), (7, 33, 2, 64), (1, 130, 1, 128)], ids=str)
def test_attention_tiled_twin(dt, shape):
    """The CUDA twin of the tiled attention kernel against the reference: o, lse (float32), dqkv."""
    B, T, H, D = shape
    rng = np.random.default_rng(T)
    h, d = data(rng, (B, T, 3, H, D), dt)
    gh, gd = data(rng, (B, T, H * D), dt)
    sc = 1 / np.sqrt(D)
    o, lse = G.attention_forward(d, sc)
    o_ref, lse_ref = R.attention_forward(h.astype(np.float32), sc)
    assert lse.dtype == cp.float32
    close(o, o_ref, dt)
    np.testing.assert_allclose(host(lse), lse_ref, rtol=1e-4, atol=1e-4)
    close(G.attention_backward(d, o, lse, gd, sc),
          R.attention_backward(h.astype(np.float32), o_ref, lse_ref, gh.astype(np.float32), sc), dt)


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(1, 1), (67, 97), (130, 768)])
def test_layernorm(dt, shape):
    rng = np.random.default_rng(1)
    (xh, xd), (wh, wd), (bh, bd) = data(rng, shape, dt, 2.0), data(rng, shape[-1:], dt), data(rng, shape[-1:], dt)
    f32 = lambda a: a.astype(np.float32)  # noqa: E731
    y, mean, rstd = G.layernorm_forward(xd, wd, bd)
    ry, rmean, rrstd = R.layernorm_forward(f32(xh), f32(wh), f32(bh))
    close(y, ry, dt), close(mean, rmean, np.float32), close(rstd, rrstd, np.float32)
    gh, gd = data(rng, shape, dt)
    dx, dw, db = G.layernorm_backward(gd, xd, wd, mean, rstd)
    rdx, rdw, rdb = R.layernorm_backward(f32(gh), f32(xh), f32(wh), rmean, rrstd)
    close(dx, rdx, dt)
    assert dw.dtype == cp.float32 and db.dtype == cp.float32
    np.testing.assert_allclose(host(dw), rdw, rtol=1e-3, atol=1e-3 * shape[0])
    np.testing.assert_allclose(host(db), rdb, rtol=1e-3, atol=1e-3 * shape[0])


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
def test_gelu(dt):
    rng = np.random.default_rng(2)
    xh, xd = data(rng, (100003,), dt, 3.0)
    gh, gd = data(rng, (100003,), dt)
    close(G.gelu_forward(xd), R.gelu_forward(xh.astype(np.float32)), dt)
    close(G.gelu_backward(xd, gd), R.gelu_backward(xh.astype(np.float32), gh.astype(np.float32)), dt)


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
def test_cross_entropy(dt):
    rng = np.random.default_rng(3)
    lh, ld = data(rng, (33, 1031), dt, 3.0)
    t = rng.integers(0, 1031, 33)
    t[::4] = -100
    loss, lse = G.cross_entropy_forward(ld, cp.asarray(t))
    rl, rlse = R.cross_entropy_forward(lh.astype(np.float32), t)
    np.testing.assert_allclose(host(loss), rl, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(host(lse), rlse, rtol=1e-4, atol=1e-4)
    for dloss in (1 / 33, rng.standard_normal(33).astype(np.float32)):
        d = G.cross_entropy_backward(ld, lse, cp.asarray(t), cp.asarray(dloss) if np.ndim(dloss) else dloss)
        close(d, R.cross_entropy_backward(lh.astype(np.float32), rlse, t, dloss), dt)


@pytest.mark.parametrize("gdt", DTYPES, ids=lambda d: d.name)
def test_adamw(gdt):
    rng = np.random.default_rng(4)
    n = 10007
    ph = rng.standard_normal(n).astype(np.float32)
    state_h = [ph.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)]
    state_d = [cp.asarray(a) for a in state_h]
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for step in (1, 2, 3):
        gh, gd = data(rng, (n,), gdt)
        G.adamw_step(state_d[0], gd, state_d[1], state_d[2], step=step, **kw)
        R.adamw_step(state_h[0], gh, state_h[1], state_h[2], step=step, **kw)
    for a, b in zip(state_d, state_h):
        np.testing.assert_allclose(host(a), b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
def test_topk_and_capacity_positions(dt):
    rng = np.random.default_rng(5)
    sh = rng.integers(0, 5, (257, 16)).astype(dt)  # ties
    for k in (1, 2, 4):
        idx, vals = G.topk(cp.asarray(sh), k)
        ridx, rvals = R.topk(sh, k)
        np.testing.assert_array_equal(host(idx), ridx)
        np.testing.assert_array_equal(host(vals).astype(np.float32), rvals.astype(np.float32))
    e = rng.integers(0, 7, 5003)
    for cap in (0, 100, 1000):
        pos, counts = G.capacity_positions(cp.asarray(e), 7, cap)
        rpos, rcounts = R.capacity_positions(e, 7, cap)
        np.testing.assert_array_equal(host(pos), rpos)
        np.testing.assert_array_equal(host(counts), rcounts)


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
def test_permute_unpermute_add(dt):
    rng = np.random.default_rng(6)
    xh, xd = data(rng, (50, 24), dt)
    rows = rng.integers(0, 50, 120)
    np.testing.assert_array_equal(host(G.permute(xd, cp.asarray(rows))).view(np.uint8), R.permute(xh, rows).view(np.uint8))
    yh, yd = data(rng, (120, 24), dt)
    wh, wd = data(rng, (120,), dt)
    for w in (None, (wh, wd)):
        got = G.unpermute_add(yd, cp.asarray(rows), None if w is None else w[1], 50)
        want = R.unpermute_add(yh.astype(np.float32), rows, None if w is None else w[0].astype(np.float32), 50)
        close(got, want, dt)


@pytest.mark.parametrize("src", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("dst", DTYPES, ids=lambda d: d.name)
def test_cast_rounds_like_numpy(src, dst):
    rng = np.random.default_rng(7)
    h = (rng.standard_normal(100003) * 100).astype(np.float32).astype(src)
    got = host(G.cast(cp.asarray(h), dst))
    np.testing.assert_array_equal(got.view(f"u{dst.itemsize}"), R.cast(h, dst).view(f"u{dst.itemsize}"))


@pytest.mark.parametrize("dt", DTYPES + [np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.int64)],
                         ids=lambda d: d.name)
@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
def test_reduce_and_scale(dt, op):
    rng = np.random.default_rng(8)
    if dt.kind == "i":
        a, b = (rng.integers(-1000, 1000, 100003).astype(dt) for _ in range(2))
    else:
        a, b = (rng.standard_normal(100003).astype(np.float32).astype(dt) for _ in range(2))
    d = cp.asarray(a)
    G.reduce_inplace(d, cp.asarray(b), op)
    want = R.reduce_inplace(a.copy(), b, op)
    np.testing.assert_array_equal(host(d).view(f"u{dt.itemsize}"), want.view(f"u{dt.itemsize}"))
    if op == "sum":
        G.scale_inplace(d, 3)
        np.testing.assert_array_equal(host(d).view(f"u{dt.itemsize}"), R.scale_inplace(want, 3).view(f"u{dt.itemsize}"))
