"""Attention's per-batch split over threads (pympar.kernels.blas.over_chunks): the same numbers
as one thread, bit for bit, and the BLAS's thread count put back afterwards."""
import numpy as np
import pytest

from pympar.kernels import blas
from pympar.nn import GPT, GPTConfig, CausalSelfAttention


def test_over_chunks_covers_range_once_and_restores_blas_threads(threads):
    seen = []
    before = blas.blas_threads()
    blas.over_chunks(7, lambda a, b: seen.append((a, b)), 3)
    assert sorted(i for a, b in seen for i in range(a, b)) == list(range(7))
    if before is not None:
        assert len(seen) == 3
        assert blas.blas_threads() == before
    seen.clear()
    blas.over_chunks(5, lambda a, b: seen.append((a, b)), 1)
    assert seen == [(0, 5)]


def test_over_chunks_propagates_errors_and_restores_blas_threads():
    before = blas.blas_threads()

    def bad(a, b):
        if a > 0:
            raise RuntimeError("chunk failed")
    with pytest.raises(RuntimeError, match="chunk failed"):
        blas.over_chunks(4, bad, 2)
    assert blas.blas_threads() == before


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_attention_threads_bit_identical(threads, dtype):
    B, T, C, nh = 5, 16, 32, 4
    rng = np.random.default_rng(3)
    x = rng.standard_normal((B, T, C)).astype(dtype)
    dy = rng.standard_normal((B, T, C)).astype(dtype)
    out = []
    for n in (1, 2, 3):
        threads(n)
        att = CausalSelfAttention(C, nh, name="a", dtype=dtype)
        y, ctx = att.forward(x)
        dx = att.backward(dy, ctx)
        out.append((y, dx, att.c_attn.weight.grad.copy(), att.c_proj.weight.grad.copy()))
    for other in out[1:]:
        for a, b in zip(out[0], other):
            assert np.array_equal(a, b)


def test_gpt_step_same_loss_and_grads_at_two_threads(threads):
    cfg = GPTConfig.from_preset("tiny")
    rng = np.random.default_rng(0)
    idx = rng.integers(0, cfg.vocab_size, (4, 32))
    res = []
    for n in (1, 2):
        threads(n)
        m = GPT(cfg, seed=1)
        loss = m.loss_and_grad(idx, idx)
        res.append((loss, {k: p.grad.copy() for k, p in m.named_parameters()}))
    assert res[0][0] == res[1][0]
    for k, g in res[0][1].items():
        np.testing.assert_allclose(res[1][1][k], g, rtol=1e-5, atol=1e-7, err_msg=k)


def test_moe_experts_threads_bit_identical(threads):
    cfg = GPTConfig.from_preset("moe-tiny")
    rng = np.random.default_rng(2)
    res = []
    for n in (1, 2):
        threads(n)
        m = GPT(cfg, seed=1)
        moe = m.h[0].moe
        x = rng.standard_normal((64, cfg.n_embd)).astype(np.float32) if not res else res[0][0]
        counts = np.array([10, 0, 30, 24])
        ys, ctx = moe.run_experts(x, counts)
        dxs = moe.run_experts_backward(2 * ys, ctx)
        grads = [p.grad.copy() for e in moe.experts for p in e.parameters()]
        res.append((x, ys, dxs, grads))
    for a, b in zip(res[0][1:3], res[1][1:3]):
        assert np.array_equal(a, b)
    for a, b in zip(res[0][3], res[1][3]):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("weights, parts, want", [
    ([300, 100, 50, 50], 2, [0, 1, 4]),          # one heavy expert alone, the rest together
    ([1, 1, 1, 1], 2, [0, 2, 4]),
    ([0, 0, 5, 0], 2, [0, 3, 4]),
    ([0, 0, 0], 2, [0, 1, 3]),                   # no weight: equal counts
    ([7], 3, [0, 1, 1, 1]),
])
def test_balanced_bounds(weights, parts, want):
    assert blas.balanced_bounds(weights, parts) == want


def test_weighted_over_chunks_covers_every_item_once(threads):
    threads(2)
    seen = []
    blas.over_chunks(6, lambda i0, i1: seen.extend(range(i0, i1)), 2, weights=[50, 1, 1, 1, 1, 60])
    assert sorted(seen) == list(range(6))

