"""Finite-difference gradient checks (float64) of the dense building blocks."""
import numpy as np
import pytest
from nn_check import check_module, rel_err

from pympar.nn import MLP, CausalSelfAttention, LayerNorm, Linear, init_param
from pympar.nn.attention_core import CausalAttentionCore


def _x(shape, seed=1):
    return np.random.default_rng(seed).standard_normal(shape)


def _randomise(module, seed=3, scale=0.3):
    """Move parameters away from their init (zero biases, unit LN weights) so every term counts."""
    rng = np.random.default_rng(seed)
    for _, p in module.named_parameters():
        p.data[...] = p.data + scale * rng.standard_normal(p.data.shape)


def test_linear_grads():
    m = Linear(5, 7, name="l", dtype=np.float64)
    _randomise(m)
    check_module(m, _x((2, 3, 5)))


def test_linear_without_bias_grads():
    m = Linear(5, 7, name="l", dtype=np.float64, bias=False)
    assert [n for n, _ in m.named_parameters()] == ["weight"]
    check_module(m, _x((4, 5)))


def test_layernorm_grads():
    m = LayerNorm(6, name="ln_1", dtype=np.float64)
    _randomise(m)
    check_module(m, _x((2, 3, 6)) * 2 + 0.5)


def test_attention_grads():
    m = CausalSelfAttention(8, 2, name="attn", dtype=np.float64)
    _randomise(m)
    check_module(m, _x((2, 5, 8)), n_samples=16)


def test_attention_is_causal():
    m = CausalSelfAttention(8, 2, name="attn", dtype=np.float64)
    _randomise(m)
    x = _x((1, 6, 8))
    y, _ = m.forward(x)
    x2 = x.copy()
    x2[:, 4:] += 1.0                      # change the future only
    y2, _ = m.forward(x2)
    np.testing.assert_allclose(y2[:, :4], y[:, :4], rtol=0, atol=1e-12)
    assert np.abs(y2[:, 4:] - y[:, 4:]).max() > 1e-3


def test_attention_core_grads():
    """The core alone: packed qkv (B, T, 3, nh, hs) -> ya, dya -> packed dqkv, against finite differences."""
    check_module(CausalAttentionCore(), _x((2, 5, 3, 3, 4)), n_samples=24)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_attention_core_heads_are_independent(dtype):
    """A head range run alone (a tp rank's local heads) gives exactly the full run's numbers for those
    heads, forward and backward: what lets TPCausalSelfAttention match the single process bit for bit."""
    B, T, nh, hs = 3, 7, 4, 5
    qkv = _x((B, T, 3, nh, hs)).astype(dtype)
    dya = _x((B, T, nh * hs), seed=2).astype(dtype)
    core = CausalAttentionCore()
    ya, ctx = core.forward(qkv)
    dqkv = core.backward(dya, ctx)
    for h0, h1 in [(0, 2), (2, 4), (1, 2)]:
        sub = np.ascontiguousarray(qkv[:, :, :, h0:h1])      # as a rank's c_attn produces it
        ya_r, ctx_r = core.forward(sub)
        dya_r = np.ascontiguousarray(dya.reshape(B, T, nh, hs)[:, :, h0:h1].reshape(B, T, -1))
        dqkv_r = core.backward(dya_r, ctx_r)
        np.testing.assert_array_equal(ya_r, ya.reshape(B, T, nh, hs)[:, :, h0:h1].reshape(B, T, -1))
        np.testing.assert_array_equal(dqkv_r, dqkv[:, :, :, h0:h1])


def test_attention_core_rejects_an_unpacked_qkv():
    with pytest.raises(ValueError, match=r"expected \(B, T, 3, n_head, head_size\)"):
        CausalAttentionCore().forward(np.zeros((2, 5, 24)).reshape(2, 5, 4, 2, 3))


def test_mlp_grads():
    m = MLP(6, name="mlp", dtype=np.float64)
    _randomise(m)
    check_module(m, _x((2, 3, 6)))


def test_gradient_check_can_fail():
    """The checker itself must catch a wrong backward."""
    m = Linear(4, 3, name="l", dtype=np.float64)
    good = m.backward
    m.backward = lambda dy, x: good(dy, x) * 1.001
    with pytest.raises(AssertionError, match="finite-difference"):
        check_module(m, _x((3, 4)))


def test_init_param_is_a_function_of_seed_name_shape():
    a = init_param(7, "transformer.h.0.attn.c_attn.weight", (24, 8), np.float64)
    b = init_param(7, "transformer.h.0.attn.c_attn.weight", (24, 8), np.float64)
    np.testing.assert_array_equal(a, b)
    assert rel_err(a, init_param(8, "transformer.h.0.attn.c_attn.weight", (24, 8), np.float64)) > 0.5
    assert rel_err(a, init_param(7, "transformer.h.1.attn.c_attn.weight", (24, 8), np.float64)) > 0.5
    assert abs(a.std() - 0.02) < 0.005
    np.testing.assert_array_equal(init_param(0, "transformer.h.0.ln_1.weight", (8,)), np.ones(8))
    np.testing.assert_array_equal(init_param(0, "transformer.h.0.ln_1.bias", (8,)), np.zeros(8))
    # float32 is the float64 tensor rounded
    np.testing.assert_array_equal(init_param(7, "w", (3, 4), np.float32),
                                  init_param(7, "w", (3, 4), np.float64).astype(np.float32))


def test_zero_grad_marks_stale_and_the_first_contribution_is_written_over():
    """zero_grad writes nothing; a stale gradient reads as zeros, and the step's first
    contribution is written over it (a GEMM straight into it for a Linear), then added to."""
    from pympar.nn.parameter import Parameter
    from pympar.nn.wgrad import accumulate
    p = Parameter(np.ones((2, 3), np.float32), name="p")
    p.grad[...] = 5.0
    buf = p.grad
    p.zero_grad()
    assert p._grad is buf and float(buf.sum()) == 30.0          # nothing written yet
    accumulate(p, np.full((2, 3), 2.0, np.float32))
    np.testing.assert_array_equal(p.grad, 2.0)                   # written over, not 5 + 2
    accumulate(p, np.full((2, 3), 1.0, np.float32))
    np.testing.assert_array_equal(p.grad, 3.0)                   # then added
    p.zero_grad()
    np.testing.assert_array_equal(p.grad, 0.0)                   # no contribution: zeros when read
    assert p.grad is buf
    rng = np.random.default_rng(4)
    lin = Linear(16, 8, name="l", seed=2)
    x, dy = rng.standard_normal((5, 16)).astype(np.float32), rng.standard_normal((5, 8)).astype(np.float32)
    lin.backward(dy, x)
    first = {n: q.grad.copy() for n, q in lin.named_parameters()}
    lin.backward(dy, x)                                          # accumulates: twice the gradient
    lin.zero_grad()
    lin.backward(dy, x)                                          # the GEMM writes into the stale buffer
    for n, q in lin.named_parameters():
        np.testing.assert_array_equal(q.grad, first[n], err_msg=n)
