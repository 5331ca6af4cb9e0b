"""Every C++ kernel (pympar._C through pympar.kernels.native) against its pure-NumPy reference.

float32 and float64 (and float16/bfloat16 where the kernel takes them), odd shapes, non-contiguous
inputs, ignored cross-entropy targets, capacity dropping order, 1 vs 2 threads bit-identical,
every instruction-set build, the forced-reference path and the no-native path.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import pympar.kernels as K
from pympar.backend import bfloat16
from pympar.kernels import reference as R

import pympar

needs_native = pytest.mark.skipif(not K.native_available(), reason="pympar._C is not built")
if K.native_available():
    from pympar.kernels import native as N
FLOATS = [np.float32, np.float64]
TOL = {np.float32: dict(rtol=2e-5, atol=2e-6), np.float64: dict(rtol=1e-12, atol=1e-13)}


def rand(rng, shape, dt, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dt)


def close(a, b, dt):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    np.testing.assert_allclose(a, b, **TOL[np.dtype(dt).type])


@pytest.fixture
def threads():
    yield
    K.set_num_threads(1)


# --- causal softmax ---------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("shape", [(1, 1), (2, 7, 7), (3, 2, 13, 13), (1, 61, 61)])
def test_softmax_causal(dt, shape):
    rng = np.random.default_rng(1)
    x = rand(rng, shape, dt, 3.0)
    T = shape[-1]
    x[..., np.triu(np.ones((T, T), bool), 1)] = np.inf  # masked entries must not leak
    y = N.softmax_causal_forward(x)
    yr = R.softmax_causal_forward(x)
    close(y, yr, dt)
    assert np.all(y[..., np.triu(np.ones((T, T), bool), 1)] == 0)
    dy = rand(rng, shape, dt)
    close(N.softmax_causal_backward(y, dy), R.softmax_causal_backward(yr, dy), dt)


@needs_native
def test_softmax_causal_noncontiguous_input_is_copied():
    x = rand(np.random.default_rng(2), (2, 9, 9), np.float32).transpose(0, 2, 1)
    assert not x.flags.c_contiguous
    close(N.softmax_causal_forward(x), R.softmax_causal_forward(x), np.float32)


# --- layernorm --------------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (2, 3, 31), (67, 97)])
def test_layernorm(dt, shape):
    rng = np.random.default_rng(3)
    x = rand(rng, shape, dt, 2.0) + 1.5
    w, b = rand(rng, shape[-1:], dt), rand(rng, shape[-1:], dt)
    got, want = N.layernorm_forward(x, w, b, 1e-5), R.layernorm_forward(x, w, b, 1e-5)
    for g_, r_ in zip(got, want):
        close(g_, r_.astype(dt), dt)
    dy = rand(rng, shape, dt)
    got = N.layernorm_backward(dy, x, w, want[1], want[2])
    for g_, r_ in zip(got, R.layernorm_backward(dy, x, w, want[1], want[2])):
        close(g_, r_.astype(dt), dt)


@needs_native
def test_layernorm_noncontiguous_input():
    rng = np.random.default_rng(4)
    x = rand(rng, (9, 40), np.float64)[:, ::2]
    w, b = rand(rng, (20,), np.float64), rand(rng, (20,), np.float64)
    for g_, r_ in zip(N.layernorm_forward(x, w, b), R.layernorm_forward(x, w, b)):
        close(g_, r_, np.float64)


# --- fused: residual add + layernorm, layernorm backward + residual, bias + GELU ---------
@needs_native
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (2, 3, 31), (67, 97)])
def test_add_layernorm_is_the_add_then_layernorm(dt, shape, threads):
    """The fused kernel equals the add and then layernorm_forward bit for bit (native), and its
    reference twin within the layernorm tolerance; x becomes the sum in both. Backward with a
    residual equals backward, then the add, bit for bit; the twin likewise."""
    rng = np.random.default_rng(11)
    x, r = rand(rng, shape, dt, 2.0) + 1.5, rand(rng, shape, dt)
    w, b = rand(rng, shape[-1:], dt), rand(rng, shape[-1:], dt)
    s = x + r
    for th in (1, 2):
        K.set_num_threads(th)
        xf = x.copy()
        got = N.add_layernorm_forward(xf, r, w, b, 1e-5)
        assert np.array_equal(xf, s)
        for g_, u_ in zip(got, N.layernorm_forward(s, w, b, 1e-5)):
            assert np.array_equal(g_, u_)
        xr = x.copy()
        want = R.add_layernorm_forward(xr, r, w, b, 1e-5)
        assert np.array_equal(xr, s)
        for g_, r_ in zip(got, want):
            close(g_, r_.astype(dt), dt)
        dy, res = rand(rng, shape, dt), rand(rng, shape, dt)
        dx, dw, db = N.layernorm_backward(dy, s, w, got[1], got[2], residual=res)
        ux, uw, ub = N.layernorm_backward(dy, s, w, got[1], got[2])
        assert np.array_equal(dx, ux + res) and np.array_equal(dw, uw) and np.array_equal(db, ub)
        for g_, r_ in zip((dx, dw, db), R.layernorm_backward(dy, s, w, got[1], got[2], residual=res)):
            close(g_, r_.astype(dt), dt)


@needs_native
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (3, 5, 64), (129, 1031)])
def test_bias_gelu_is_the_add_then_gelu(dt, shape, threads):
    """h += b, then GELU: the fused kernel equals the add and gelu_forward bit for bit at 1 and 2
    threads, and its reference twin as test_gelu judges gelu_forward (h the same sum in both)."""
    rng = np.random.default_rng(12)
    h, b = rand(rng, shape, dt, 3.0), rand(rng, shape[-1:], dt)
    s = h + b
    for th in (1, 2):
        K.set_num_threads(th)
        hf = h.copy()
        y = N.bias_gelu_forward(hf, b)
        assert np.array_equal(hf, s) and np.array_equal(y, N.gelu_forward(s))
    hr = h.copy()
    yr = R.bias_gelu_forward(hr, b)
    assert np.array_equal(hr, s)
    exact = R.gelu_forward(s.astype(np.float64))
    tol = dict(rtol=1e-5, atol=1e-5) if dt is np.float32 else dict(rtol=1e-12, atol=1e-13)
    for got in (y, yr):
        np.testing.assert_allclose(got, exact, **tol)


@needs_native
def test_fused_kernels_hand_what_they_cannot_take_to_the_unfused_kernels():
    """A non-contiguous or read-only target, a float16 one, a bias of another dtype: answered
    unfused (the add in place, then the kernel's own path: native where it can, else the
    reference), which updates the target in place all the same."""
    rng = np.random.default_rng(13)
    h = rand(rng, (6, 16), np.float32)[:, ::2]                # non-contiguous
    b = rand(rng, (8,), np.float32)
    s = h + b
    y = K.bias_gelu_forward(h, b)
    assert np.array_equal(h, s) and np.allclose(y, R.gelu_forward(s), rtol=1e-5, atol=1e-6)
    assert np.array_equal(y, K.gelu_forward(s))
    x16, r16 = rand(rng, (4, 8), np.float16), rand(rng, (4, 8), np.float16)
    w16, b16 = np.ones(8, np.float16), np.zeros(8, np.float16)
    s16 = x16 + r16
    got = K.add_layernorm_forward(x16, r16, w16, b16)
    assert np.array_equal(x16, s16)
    for g_, r_ in zip(got, R.layernorm_forward(s16, w16, b16)):
        assert np.array_equal(g_, r_)


# --- a GEMM's bias: the add in forward, the column sums in backward; the embedding's scatter-add
@needs_native
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("shape", [(0, 5), (1, 7), (7, 13), (3, 5, 64), (129, 1031), (1031, 257)])
def test_bias_add_and_column_sum_are_numpys_bit_for_bit(dt, shape, threads):
    """y += b and x.sum(axis=0) (NumPy adds the rows one after another, in order): the kernels
    give the same numbers bit for bit at 1, 2 and 3 threads (the threads split rows for the add,
    columns for the sums, so each column is still summed in row order), into out= too."""
    rng = np.random.default_rng(21)
    y, b = rand(rng, shape, dt, 3.0), rand(rng, shape[-1:], dt)
    x = rand(rng, (int(np.prod(shape[:-1])), shape[-1]), dt, 3.0)
    want_y, want_s = y + b, x.sum(axis=0)
    for th in (1, 2, 3):
        K.set_num_threads(th)
        got = y.copy()
        assert N.bias_add(got, b) is got and np.array_equal(got, want_y)
        s = N.column_sum(x)
        assert s.dtype == x.dtype and np.array_equal(s, want_s)
        o = np.full(shape[-1], np.nan, dtype=dt)
        assert N.column_sum(x, dt, out=o) is o and np.array_equal(o, want_s)
    assert np.array_equal(R.column_sum(x), want_s)


@needs_native
def test_column_sum_bits_differ_from_another_order():
    """The bit-for-bit check above can fail: summing the same rows pairwise (another order)
    gives other float32 numbers for this x, so equality says the kernel keeps NumPy's order."""
    rng = np.random.default_rng(22)
    x = rand(rng, (1024, 64), np.float32, 3.0)
    pairwise = x.reshape(2, 512, 64).sum(axis=1).sum(axis=0)
    assert not np.array_equal(pairwise, x.sum(axis=0))
    assert np.array_equal(N.column_sum(x), x.sum(axis=0))


@needs_native
@pytest.mark.parametrize("dt", FLOATS)
def test_scatter_add_is_add_at_bit_for_bit(dt, threads):
    """dst[idx] += src with repeated indices: the same numbers as np.add.at (each row's additions
    in the order of the tokens) at 1, 2 and 3 threads, in place on dst; negative indices count from
    the end as in NumPy, an index out of range is an IndexError, as np.add.at says, and no rows
    at all leave dst as it was."""
    rng = np.random.default_rng(23)
    V, C, M = 300, 37, 2000
    dst = rand(rng, (V, C), dt)
    idx = rng.integers(0, 20, size=M)                         # many repeats of few rows
    idx[::7] = rng.integers(0, V, size=idx[::7].shape)
    idx[3] = -1
    src = rand(rng, (M, C), dt, 2.0)
    want = dst.copy()
    np.add.at(want, idx, src)
    for th in (1, 2, 3):
        K.set_num_threads(th)
        got = dst.copy()
        assert N.scatter_add(got, idx, src) is got and np.array_equal(got, want)
    got = dst.copy()
    assert np.array_equal(R.scatter_add(got, idx, src), want)
    with pytest.raises(IndexError):
        N.scatter_add(dst.copy(), np.array([0, V]), src[:2])
    # no rows at all (a vocabulary shard that owns none of the batch's tokens): dst unchanged
    got = dst.copy()
    assert N.scatter_add(got, np.array([], dtype=np.int64), src[:0]) is got and np.array_equal(got, dst)


@needs_native
def test_bias_kernels_hand_what_they_cannot_take_to_numpy():
    """A non-contiguous target or input, another dtype (float16 rows summed in float32), a bias of
    another dtype: answered by NumPy itself, with its numbers."""
    rng = np.random.default_rng(24)
    y = rand(rng, (6, 16), np.float32)[:, ::2]
    b = rand(rng, (8,), np.float64)
    want = y.copy()
    want += b                                                 # NumPy's own in-place add
    got = y.copy()
    assert np.array_equal(K.bias_add(got, b), want)
    yv = rand(rng, (6, 16), np.float32)
    view = yv[:, ::2]
    wantv = view + b.astype(np.float32)
    K.bias_add(view, b.astype(np.float32))
    assert np.array_equal(yv[:, ::2], wantv)
    x16 = rand(rng, (33, 8), np.float16)
    s = K.column_sum(x16, np.float32)
    assert s.dtype == np.float32 and np.array_equal(s, x16.sum(axis=0, dtype=np.float32))
    xt = rand(rng, (8, 33), np.float32).T                     # F-ordered
    assert np.array_equal(K.column_sum(xt), xt.sum(axis=0))
    dst = np.zeros((4, 8), np.float32)
    idx = np.array([1, 1, 3])
    src = rand(rng, (3, 8), np.float64)
    want = dst.copy()
    np.add.at(want, idx, src)
    assert np.array_equal(K.scatter_add(dst, idx, src), want)


# --- GELU -------------------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("n", [1, 7, 1009, 70001])
def test_gelu(dt, n):
    rng = np.random.default_rng(5)
    x = rand(rng, (n,), dt, 4.0)
    x[:1] = -30.0 if n > 1 else x[:1]  # deep negative tail: y -> -0, no overflow
    dy = rand(rng, (n,), dt)
    got = [N.gelu_forward(x), N.gelu_backward(x, dy)]
    ref = [R.gelu_forward(x), R.gelu_backward(x, dy)]
    if dt is np.float64:
        for a, b in zip(got, ref):
            close(a, b, dt)
        return
    # float32: the reference's 1 + tanh(u) cancels in the negative tail, so both are judged
    # against the float64 evaluation: the native kernel must be about as accurate
    exact = [R.gelu_forward(x.astype(np.float64)), R.gelu_backward(x.astype(np.float64), dy.astype(np.float64))]
    for a, b, e in zip(got, ref, exact):
        assert a.dtype == np.float32
        err, ref_err = np.abs(a - e).max(), np.abs(b - e).max()
        assert err <= 2 * ref_err + 1e-6, (err, ref_err)
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("impl", ["native", "reference"])
@pytest.mark.parametrize("dt", FLOATS)
def test_gelu_backward_in_place(impl, dt):
    """gelu_backward(x, dy, out=dy) and out=x write over their input: the same numbers, bitwise."""
    if impl == "native" and not K.native_available():
        pytest.skip("pympar._C is not built")
    M = N if impl == "native" else R
    rng = np.random.default_rng(6)
    x, dy = rand(rng, (4097,), dt, 4.0), rand(rng, (4097,), dt)
    want = M.gelu_backward(x, dy)
    for which in ("dy", "x"):
        xx, dd = x.copy(), dy.copy()
        out = dd if which == "dy" else xx
        got = M.gelu_backward(xx, dd, out=out)
        assert got is out, which
        np.testing.assert_array_equal(got, want, err_msg=which)


# --- fused cross-entropy ----------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("NV", [(1, 1), (13, 97), (5, 1031)])
def test_cross_entropy(dt, NV):
    n, v = NV
    rng = np.random.default_rng(6)
    logits = rand(rng, (n, v), dt, 4.0)
    t = rng.integers(0, v, n)
    t[::3] = -100  # ignored rows
    loss, lse = N.cross_entropy_forward(logits, t)
    rl, rlse = R.cross_entropy_forward(logits, t)
    close(loss, rl, dt)
    close(lse, rlse, dt)
    assert np.all(loss[::3] == 0)
    for dloss in (1.0 / n, rand(rng, (n,), dt)):
        d = N.cross_entropy_backward(logits, lse, t, dloss)
        close(d, R.cross_entropy_backward(logits, rlse, t, dloss), dt)
        assert np.all(d[::3] == 0)
        for impl in (N, R):                    # written over the logits: the same values, in place
            buf = logits.copy()
            got = impl.cross_entropy_backward(buf, lse, t, dloss, out=buf)
            assert got is buf
            np.testing.assert_array_equal(got, impl.cross_entropy_backward(logits, lse, t, dloss))


@needs_native
def test_cross_entropy_target_out_of_range_is_an_error():
    with pytest.raises(IndexError, match="vocabulary size 5"):
        N.cross_entropy_forward(np.zeros((2, 5), np.float32), np.array([1, 5]))


# --- AdamW ------------------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("pdt,gdt", [(np.float32, np.float32), (np.float64, np.float64),
                                     (np.float32, np.float16), (np.float32, "bf16")])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adamw(pdt, gdt, wd):
    gdt = bfloat16 if gdt == "bf16" else gdt
    rng = np.random.default_rng(7)
    n = 1037
    state = [rand(rng, (n,), pdt), np.zeros(n, pdt), np.zeros(n, pdt)]
    ref = [a.copy() for a in state]
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=wd)
    for step in (1, 2, 3):
        g = rand(rng, (n,), np.float32).astype(gdt)
        N.adamw_step(state[0], g, state[1], state[2], step=step, **kw)
        R.adamw_step(ref[0], g, ref[1], ref[2], step=step, **kw)
    for a, b in zip(state, ref):
        close(a, b, pdt)


@needs_native
def test_adamw_noncontiguous_parameter_updates_in_place():
    rng = np.random.default_rng(8)
    p = rand(rng, (6, 8), np.float32)[:, ::2]
    m, v = np.zeros((6, 4), np.float32), np.zeros((6, 4), np.float32)
    want = p.copy()
    g = rand(rng, (6, 4), np.float32)
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=1)
    K.adamw_step(p, g, m, v, **kw)
    R.adamw_step(want, g, np.zeros_like(m), np.zeros_like(v), **kw)
    close(p, want, np.float32)


# --- MoE routing ------------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("k", [1, 2, 8])
def test_topk_ties_pick_lower_index(dt, k):
    rng = np.random.default_rng(9)
    s = rng.integers(0, 4, (31, 8)).astype(dt)  # many ties
    s[3, 2] = np.nan  # NaN ranks last, as argsort(-s) puts it
    idx, vals = N.topk(s, k)
    ridx, rvals = R.topk(s, k)
    np.testing.assert_array_equal(idx, ridx)
    np.testing.assert_array_equal(vals, rvals)


@needs_native
@pytest.mark.parametrize("capacity", [0, 1, 3])
def test_capacity_positions_drops_in_priority_order(capacity):
    e = np.array([2, 0, 2, 2, 1, 0, 2, 1, 0, 0])
    pos, counts = N.capacity_positions(e, 4, capacity)
    rpos, rcounts = R.capacity_positions(e, 4, capacity)
    np.testing.assert_array_equal(pos, rpos)
    np.testing.assert_array_equal(counts, [4, 2, 4, 0])
    np.testing.assert_array_equal(counts, rcounts)
    if capacity == 1:  # the first assignment of each expert keeps slot 0, later ones drop
        np.testing.assert_array_equal(pos, [0, 0, -1, -1, 0, -1, -1, -1, -1, -1])


@needs_native
def test_capacity_positions_rejects_bad_expert():
    with pytest.raises(IndexError, match="outside"):
        N.capacity_positions(np.array([0, 4]), 4, 0)


@needs_native
@pytest.mark.parametrize("dt", FLOATS + [np.int32])
def test_permute_and_unpermute_add(dt):
    rng = np.random.default_rng(10)
    x = (rng.standard_normal((11, 5)) * 10).astype(dt)
    rows = rng.integers(0, 11, 23)  # duplicates
    rows[0] = -1  # NumPy's negative index
    np.testing.assert_array_equal(N.permute(x, rows), R.permute(x, rows))
    if dt is np.int32:
        return
    y = rand(rng, (23, 5), dt)
    w = rand(rng, (23,), dt)
    for weights in (None, w):
        got = N.unpermute_add(y, rows % 11, weights, 11)
        np.testing.assert_array_equal(got, R.unpermute_add(y, rows % 11, weights, 11))  # same order of adds
    # an expert given no rows: zeros, as the reference (the row width is the output's, not y's)
    none = N.unpermute_add(y[:0], rows[:0], None, 11)
    assert none.shape == (11, 5) and not none.any()
    with pytest.raises(IndexError, match="out of bounds"):
        N.permute(x, np.array([11]))


# --- casts, reductions, scaling ---------------------------------------------------------
SPECIALS = np.array([0.0, -0.0, 1.0, -2.5, 65504.0, 65519.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 1e-5,
                     1e-40, 3.4e38, np.inf, -np.inf, np.nan, 1.00048828125, 1.000732421875,
                     1.00390625, 1.01171875], dtype=np.float32)
HALVES = [np.dtype(np.float16), bfloat16]


@needs_native
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy warns on the inf/NaN it casts
@pytest.mark.parametrize("src", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("dst", ["float32", "float64", "float16", "bfloat16"])
def test_cast_rounds_like_numpy(src, dst):
    sd, dd = (bfloat16 if s == "bfloat16" else np.dtype(s) for s in (src, dst))
    rng = np.random.default_rng(11)
    base = np.concatenate([SPECIALS, -SPECIALS, rng.standard_normal(70001).astype(np.float32) * 100,
                           rng.integers(0, 2**32, 5000, dtype=np.uint32).view(np.float32)])
    x = base.astype(sd)
    got, want = N.cast(x, dd), R.cast(x, dd)
    assert got.dtype == want.dtype
    if dd.itemsize == 2:
        np.testing.assert_array_equal(got.view(np.uint16)[~np.isnan(want)], want.view(np.uint16)[~np.isnan(want)])
    else:
        np.testing.assert_array_equal(got[~np.isnan(want)], want[~np.isnan(want)])
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32)))


REDUCE_DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), bfloat16,
                 np.dtype(np.int32), np.dtype(np.int64)]


@needs_native
@pytest.mark.parametrize("dt", REDUCE_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
@pytest.mark.parametrize("n", [1, 1031, 200003])
def test_reduce_inplace_matches_reference_exactly(dt, op, n):
    rng = np.random.default_rng(12)
    if dt.kind == "i":
        a, b = (rng.integers(-2**31, 2**31, n).astype(dt) for _ in range(2))  # wraps on sum/prod
    else:
        a, b = (rng.standard_normal(n).astype(np.float32).astype(dt) * dt.type(3) for _ in range(2))
        a[n // 2] = np.nan  # NaN propagates (max/min included)
    want = R.reduce_inplace(a.copy(), b, op)
    got = a.copy()
    assert N.reduce_inplace(got, b, op) is got
    np.testing.assert_array_equal(got.view(f"u{dt.itemsize}"), want.view(f"u{dt.itemsize}"))


@needs_native
def test_reduce_inplace_bad_op_and_noncontiguous_dst():
    with pytest.raises(ValueError, match="expected sum, max, min or prod"):
        K.reduce_inplace(np.ones(3), np.ones(3), "mean")
    d = np.ones((4, 6))[:, ::2]
    K.reduce_inplace(d, np.full((4, 3), 2.0), "sum")  # reference handles the strided target in place
    np.testing.assert_array_equal(d, 3.0)


@needs_native
@pytest.mark.parametrize("dt", REDUCE_DTYPES, ids=lambda d: d.name)
def test_scale_inplace(dt):
    rng = np.random.default_rng(13)
    x = (rng.standard_normal(100003) * 50).astype(dt)
    for alpha in (0.37, 3):
        want = R.scale_inplace(x.copy(), alpha)
        got = N.scale_inplace(x.copy(), alpha)
        np.testing.assert_array_equal(got.view(f"u{dt.itemsize}"), want.view(f"u{dt.itemsize}"))


@needs_native
def test_low_precision_math_falls_back_to_reference():
    x = np.linspace(-3, 3, 101).astype(np.float16)
    np.testing.assert_array_equal(K.gelu_forward(x), R.gelu_forward(x))


# --- threads ----------------------------------------------------------------------------
@needs_native
def test_threads_1_and_2_bit_identical(threads):
    rng = np.random.default_rng(14)
    x = rand(rng, (300, 517), np.float32)
    w, b = rand(rng, (517,), np.float32), rand(rng, (517,), np.float32)
    att = rand(rng, (4, 130, 130), np.float32)
    t = rng.integers(-1, 517, 300)
    big = rand(rng, (300001,), np.float32)
    e = rng.integers(0, 8, 300)

    def run():
        y, mu, rs = N.layernorm_forward(x, w, b)
        acc = big.copy()
        N.reduce_inplace(acc, big, "sum")
        return [y, mu, rs, *N.layernorm_backward(x, x, w, mu, rs), N.gelu_forward(big), N.gelu_backward(big, big),
                N.softmax_causal_forward(att), N.cross_entropy_forward(x, t)[0], acc,
                N.topk(x, 3)[0], N.unpermute_add(x, e, None, 8), N.cast(big, bfloat16).view(np.uint16)]

    K.set_num_threads(1)
    one = run()
    K.set_num_threads(2)
    assert K.get_num_threads() == 2
    two = run()
    for a, b_ in zip(one, two):
        np.testing.assert_array_equal(a, b_)


def test_set_num_threads_rejects_zero():
    with pytest.raises(ValueError, match=">= 1"):
        K.set_num_threads(0)


# --- other paths: every ISA build, forced reference, no native module -------------------
ISA_CHECK = textwrap.dedent("""
    import numpy as np, pympar.kernels as K
    from pympar.config import apply_environment
    from pympar.kernels import native as N, reference as R
    apply_environment()          # PYMPAR_ISA, as an application reads it
    assert K.native_isa() == "{isa}", K.native_isa()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((33, 257)).astype(np.float32)
    w = np.ones(257, np.float32)
    for a, b in zip(N.layernorm_forward(x, w, w), R.layernorm_forward(x, w, w)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(N.gelu_forward(x), R.gelu_forward(x), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(N.cross_entropy_forward(x, np.arange(33))[1], R.cross_entropy_forward(x, np.arange(33))[1], rtol=2e-5)
    d = x.copy(); N.reduce_inplace(d, x, "max"); np.testing.assert_array_equal(d, x)
    np.testing.assert_array_equal(N.cast(x, np.float16), x.astype(np.float16))
    qkv = rng.standard_normal((2, 70, 3, 2, 24)).astype(np.float32)
    got, want = N.attention_forward(qkv, 0.2), R.attention_forward(qkv, 0.2)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(N.attention_backward(qkv, *got, got[0], 0.2),
                               R.attention_backward(qkv, *want, want[0], 0.2), rtol=1e-5, atol=1e-5)
    print("ok")
""")


def _run(code, **env):
    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True,
                          text=True, timeout=60)


def _cpu_flags():
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


@needs_native
@pytest.mark.parametrize("isa,flags", [("generic", set()), ("avx2", {"avx2", "fma", "f16c"}),
                                       ("avx512", {"avx512f", "avx512bw", "avx512dq", "avx512vl"})])
def test_every_isa_build(isa, flags):
    if not flags <= _cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(flags - _cpu_flags())}")
    r = _run(ISA_CHECK.format(isa=isa), PYMPAR_ISA=isa)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_forced_reference():
    x = np.linspace(-2, 2, 11).astype(np.float32)
    K.use_reference(True)
    try:
        assert K.backend(x) == "reference"
        np.testing.assert_array_equal(K.gelu_forward(x), R.gelu_forward(x))
    finally:
        K.use_reference(False)
    assert K.backend(x) == ("cpp" if K.native_available() else "reference")


def test_forced_reference_by_environment():
    r = _run("import numpy as np, pympar.kernels as K, pympar.config as C; C.apply_environment(); "
             "print(K.backend(np.zeros(1)))", PYMPAR_KERNELS="reference")
    assert r.returncode == 0 and r.stdout.strip() == "reference", r.stderr[-2000:]


def test_without_native_module_the_reference_serves():
    code = textwrap.dedent("""
        import sys
        class Block:  # make pympar._C and pympar._cuda unimportable
            def find_spec(self, name, path=None, target=None):
                if name in ("pympar._C", "pympar._cuda"):
                    raise ImportError("blocked for the test")
        sys.meta_path.insert(0, Block())
        import numpy as np, pympar.kernels as K
        assert not K.native_available() and not K.cuda_available()
        x = np.linspace(-2, 2, 11).astype(np.float32)
        assert K.backend(x) == "reference"
        y, mu, rs = K.layernorm_forward(x[None], np.ones(11, np.float32), np.zeros(11, np.float32))
        d = x.copy(); K.reduce_inplace(d, x); assert np.array_equal(d, 2 * x)
        K.set_num_threads(2)
        print("ok")
    """)
    r = _run(code)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


@needs_native
def test_thread_pool_survives_fork():
    code = textwrap.dedent("""
        import os, numpy as np, pympar.kernels as K
        K.set_num_threads(2)
        x = np.ones(1 << 20, np.float32)
        K.reduce_inplace(x, x)  # the pool's workers exist now
        pid = os.fork()
        if pid == 0:  # the child has no workers: it must rebuild them, not wait for ghosts
            y = np.ones(1 << 20, np.float32)
            K.reduce_inplace(y, y)
            os._exit(0 if (y == 2).all() else 3)
        _, status = os.waitpid(pid, 0)
        K.reduce_inplace(x, x)
        print("ok" if os.waitstatus_to_exitcode(status) == 0 and (x == 4).all() else "bad")
    """)
    r = _run(code)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr[-2000:]


@needs_native
def test_resizing_the_pool_between_calls(threads):
    # a worker spawned by a resize once re-ran the previous job (with its freed closure)
    x = np.ones(300001, np.float32)
    for n in (2, 1, 2, 3, 2, 1, 2) * 5:
        K.set_num_threads(n)
        y = x.copy()
        N.reduce_inplace(y, x, "sum")
        assert (y == 2).all()
