"""MoE layer: routing rules and finite-difference gradients (float64), away from routing ties."""
import numpy as np
import pytest
from nn_check import check_module, rel_err

from pympar.nn import MLP, MoE


def _moe(k, cf, shared=False, E=4, C=6, seed=0, router_scale=1.0):
    m = MoE(C, E, name="moe", top_k=k, capacity_factor=cf, shared_expert=shared, aux_coef=0.1,
            z_coef=0.01, dtype=np.float64, seed=seed)
    rng = np.random.default_rng(seed + 10)
    for n, p in m.named_parameters():
        p.data[...] += 0.3 * rng.standard_normal(p.data.shape)
    m.router.weight.data[...] = router_scale * rng.standard_normal(m.router.weight.data.shape)
    return m


def _margin(m, x):
    """Smallest gap between the k-th and (k+1)-th selection score over tokens (1 when k = E)."""
    _, ctx = m.forward(x)
    s = np.sort(ctx["probs"] + m.expert_bias, axis=1)[:, ::-1]
    return 1.0 if m.top_k == m.n_expert else float((s[:, m.top_k - 1] - s[:, m.top_k]).min())


def _x_away_from_ties(m, shape, min_margin=1e-3):
    """The first input (seeds 0, 1, ...) whose top-k choice is at least min_margin from a tie,
    so a finite-difference step of 1e-6 cannot change the routing."""
    for seed in range(100):
        x = np.random.default_rng(seed).standard_normal(shape)
        if _margin(m, x) > min_margin:
            return x
    raise AssertionError("no input away from routing ties found")


CASES = [(1, 0.0, False), (2, 0.0, False), (1, 1.0, False), (2, 1.0, False), (2, 0.5, True),
         (3, 0.0, True)]


@pytest.mark.parametrize("k,cf,shared", CASES)
def test_moe_grads_match_finite_differences(k, cf, shared):
    m = _moe(k, cf, shared)
    x = _x_away_from_ties(m, (2, 6, 6))
    _, ctx = m.forward(x)
    n_kept = len(ctx["order"])
    if cf and cf < 1.5:
        assert n_kept < k * 12, "capacity-limited case should drop something"
    check_module(m, x, n_samples=10, backward_kwargs=dict(daux=1.0))
    assert ctx["aux"] > 0 and ctx["z"] > 0


def test_daux_scales_only_the_loss_terms():
    m = _moe(2, 0.0)
    x = np.random.default_rng(2).standard_normal((1, 5, 6))
    _, ctx = m.forward(x)
    dy = np.zeros_like(x)
    m.zero_grad()
    dx1 = m.backward(dy, ctx, daux=1.0)
    g1 = m.router.weight.grad.copy()
    m.zero_grad()
    dx3 = m.backward(dy, ctx, daux=3.0)
    np.testing.assert_allclose(dx3, 3 * dx1, rtol=1e-12)
    np.testing.assert_allclose(m.router.weight.grad, 3 * g1, rtol=1e-12)
    assert np.abs(g1).max() > 0


def test_choice_major_capacity_priority_and_gates():
    """E=2, k=2, 3 tokens, capacity ceil(2*3*0.5/2)=2: first choices fill before second ones."""
    m = MoE(2, 2, name="moe", top_k=2, capacity_factor=0.5, dtype=np.float64, aux_coef=0, z_coef=0)
    m.router.weight.data[...] = np.eye(2) * 4.0
    # tokens 0,1 prefer expert 0; token 2 prefers expert 1
    x = np.array([[[1.0, 0.0], [0.8, 0.1], [0.0, 1.0]]])
    _, ctx = m.forward(x)
    probs = ctx["probs"]
    # expert 0: first choices of tokens 0, 1 (2 slots) -> token 2's second choice dropped
    # expert 1: first choice of token 2, then second choice of token 0; token 1's dropped
    kept = {(int(t), int(e)) for t, e in zip(ctx["rows"], np.repeat([0, 1], [2, 2]))}
    assert kept == {(0, 0), (1, 0), (2, 1), (0, 1)}
    np.testing.assert_allclose(ctx["gates"].sum(axis=1), 1.0)   # renormalised for k > 1
    np.testing.assert_allclose(ctx["gates"][:, 0], probs.max(axis=1) / probs.sum(axis=1))
    stats = m.take_stats()
    assert stats["tokens_per_expert"] == [3, 3]
    assert stats["dropped_fraction"] == pytest.approx(2 / 6)
    assert m.take_stats()["dropped_fraction"] == 0.0   # counters reset


def test_k1_gate_is_raw_probability_and_dropped_tokens_output_zero():
    m = MoE(3, 3, name="moe", top_k=1, capacity_factor=1.0, dtype=np.float64)
    m.router.weight.data[...] = 0
    m.router.weight.data[0, 0] = 5.0          # every token with x0 > 0 picks expert 0
    x = np.abs(np.random.default_rng(0).standard_normal((1, 6, 3))) + 0.5
    y, ctx = m.forward(x)
    cap = m.capacity(6)                      # ceil(1*6*1/3) = 2
    assert cap == 2 and len(ctx["order"]) == 2
    np.testing.assert_array_equal(ctx["rows"], [0, 1])   # token order
    np.testing.assert_allclose(ctx["gates"][:, 0], ctx["probs"][:, 0])
    np.testing.assert_array_equal(y[0, 2:], 0.0)
    want = m.experts[0].forward(x[0, :2])[0] * ctx["probs"][:2, :1]
    np.testing.assert_allclose(y[0, :2], want, rtol=1e-12)


def test_dropless_equals_dense_expert_sum():
    m = _moe(2, 0.0, shared=True)
    x = np.random.default_rng(5).standard_normal((2, 4, 6))
    y, ctx = m.forward(x)
    xf = x.reshape(-1, 6)
    want = m.shared.forward(xf)[0]
    for t in range(xf.shape[0]):
        for j in range(2):
            e = ctx["idx"][t, j]
            want[t] += ctx["gates"][t, j] * m.experts[e].forward(xf[t:t + 1])[0][0]
    assert rel_err(y.reshape(-1, 6), want) < 1e-12


def test_aux_and_z_loss_formulas():
    m = _moe(2, 0.0)
    x = np.random.default_rng(6).standard_normal((1, 8, 6))
    _, ctx = m.forward(x)
    logits = x.reshape(8, 6) @ m.router.weight.data.T
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    counts = np.bincount(np.argsort(-p, axis=1)[:, :2].ravel(), minlength=4)
    aux = 0.1 * 4 * ((counts / 16) * p.mean(0)).sum()
    lse = np.log(np.exp(logits).sum(1))
    assert ctx["aux"] == pytest.approx(aux, rel=1e-12)
    assert ctx["z"] == pytest.approx(0.01 * (lse ** 2).mean(), rel=1e-12)


def test_expert_bias_changes_selection_not_gates():
    m = _moe(1, 0.0)
    x = np.random.default_rng(7).standard_normal((1, 8, 6))
    _, c0 = m.forward(x)
    m.expert_bias[:] = [10.0, 0, 0, 0]         # everyone selects expert 0 now
    _, c1 = m.forward(x)
    assert (c1["idx"][:, 0] == 0).all() and not (c0["idx"][:, 0] == 0).all()
    np.testing.assert_allclose(c1["gates"][:, 0], c1["probs"][:, 0])   # raw prob, no bias


def test_update_expert_bias_moves_towards_balance():
    m = _moe(1, 0.0)
    m.bias_update_rate = 0.01
    m._load_since_update[:] = [10, 2, 2, 2]
    m.update_expert_bias()
    np.testing.assert_allclose(m.expert_bias, [-0.01, 0.01, 0.01, 0.01])
    assert m._load_since_update.sum() == 0


def test_expert_is_an_mlp():
    m = _moe(2, 0.0)
    assert all(isinstance(e, MLP) for e in m.experts)
    names = [n for n, _ in m.named_parameters()]
    assert names[0] == "router.weight" and "experts.3.c_proj.bias" in names
