"""Whole-model checks: finite differences (float64), config, state dict, mixed precision, training."""
import inspect

import numpy as np
import pytest
from nn_check import fd_grad, rel_err, sample_indices

from pympar.nn import GPT, PRESETS, GPTConfig
from pympar.optim import AdamW, clip_grad_norm, cosine_lr

DENSE = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8)
MOE = dict(DENSE, n_expert=4, top_k=2, capacity_factor=1.0, shared_expert=True, aux_coef=0.05,
           z_coef=0.01)


def _batch(cfg, B=2, seed=0):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, cfg.vocab_size, (B, cfg.block_size))
    return idx, rng.integers(0, cfg.vocab_size, (B, cfg.block_size))


def _perturbed_model(cfg, seed=0, scale=0.2):
    m = GPT(cfg, seed=seed, dtype=np.float64)
    rng = np.random.default_rng(seed + 100)
    for _, p in m.named_parameters():
        p.data += scale * rng.standard_normal(p.data.shape)
    return m


def _routing_margin(m, idx, tg):
    """Smallest gap between the k-th and (k+1)-th router probability over all MoE layers."""
    _, _, (_, ctxs, _) = m._forward(idx, tg)
    gaps = []
    for c in ctxs:
        if isinstance(c["ffn"], dict):
            s = -np.sort(-c["ffn"]["probs"], axis=1)
            k = c["ffn"]["idx"].shape[1]
            gaps.append((s[:, k - 1] - s[:, k]).min())
    return min(gaps)


@pytest.mark.parametrize("kind,k", [("dense", 0), ("moe", 1), ("moe", 2)])
def test_gpt_grads_match_finite_differences(kind, k):
    cfg = GPTConfig(**(DENSE if kind == "dense" else dict(MOE, top_k=k)))
    m = _perturbed_model(cfg)
    idx, tg = _batch(cfg)
    tg[0, 3] = -1                                     # an ignored target
    m.zero_grad()
    loss = m.loss_and_grad(idx, tg, grad_scale=1.0)
    assert loss == pytest.approx(m.forward_loss(idx, tg), rel=1e-14)
    if kind == "moe":   # routing must sit away from ties so a 1e-6 step cannot flip it
        assert _routing_margin(m, idx, tg) > 1e-4
    rng = np.random.default_rng(1)
    errs = {}
    for name, p in m.named_parameters():
        ix = sample_indices(p.data.shape, 6, rng)
        errs[name] = rel_err([p.grad[i] for i in ix], fd_grad(lambda: m.forward_loss(idx, tg), p.data, ix))
    bad = {n: e for n, e in errs.items() if not e < 1e-6}
    assert not bad, bad


def test_grad_scale_and_accumulation():
    cfg = GPTConfig(**MOE)
    m = GPT(cfg, seed=1, dtype=np.float64)
    idx, tg = _batch(cfg)
    m.loss_and_grad(idx, tg, grad_scale=1.0)
    g1 = {n: p.grad.copy() for n, p in m.named_parameters()}
    m.zero_grad()
    m.loss_and_grad(idx, tg, grad_scale=0.5)
    m.loss_and_grad(idx, tg, grad_scale=0.5)        # two accumulated halves = one whole
    for n, p in m.named_parameters():
        np.testing.assert_allclose(p.grad, g1[n], rtol=1e-10, atol=1e-15, err_msg=n)


def test_names_and_tied_head():
    m = GPT(GPTConfig(**MOE))
    names = [n for n, _ in m.named_parameters()]
    assert len(names) == len(set(names))
    assert names[:2] == ["transformer.wte.weight", "transformer.wpe.weight"]
    assert "transformer.h.1.moe.router.weight" in names and "transformer.ln_f.bias" in names
    assert "transformer.h.0.moe.shared.c_fc.weight" in names
    assert "lm_head.weight" not in names
    assert m.head.wte is m.embedding.wte
    assert dict(m.named_parameters())["transformer.h.0.attn.c_attn.weight"].shape == (24, 8)


def test_moe_every():
    m = GPT(GPTConfig(**dict(MOE, n_layer=4, moe_every=2)))
    assert [hasattr(b, "moe") for b in m.h] == [False, True, False, True]


def test_state_dict_roundtrip_and_errors():
    cfg = GPTConfig(**MOE)
    a, b = GPT(cfg, seed=1), GPT(cfg, seed=2)
    idx, tg = _batch(cfg)
    assert a.forward_loss(idx, tg) != b.forward_loss(idx, tg)
    sd = a.state_dict()
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    b.load_state_dict(sd)
    assert a.forward_loss(idx, tg) == b.forward_loss(idx, tg)
    bad = dict(sd)
    bad["transformer.wpe.weight"] = np.zeros((3, 3))
    with pytest.raises(ValueError, match="shape"):
        b.load_state_dict(bad)
    bad = dict(sd)
    del bad["transformer.ln_f.bias"]
    with pytest.raises(ValueError, match="missing"):
        b.load_state_dict(bad)


def test_config_validation_and_presets():
    with pytest.raises(ValueError, match="n_embd=10 is not divisible by n_head=3"):
        GPTConfig(n_embd=10, n_head=3).validate()
    with pytest.raises(ValueError, match="top_k=5"):
        GPTConfig(n_expert=4, top_k=5).validate()
    with pytest.raises(ValueError, match="unknown preset"):
        GPTConfig.from_preset("nope")
    for name in ("tiny", "small", "gpt2-124m", "moe-tiny", "moe-small"):
        assert name in PRESETS
        GPTConfig.from_preset(name)
    assert GPTConfig.from_preset("moe-tiny", top_k=1).top_k == 1


def test_seed_determinism():
    cfg = GPTConfig(**DENSE)
    a, b = GPT(cfg, seed=3), GPT(cfg, seed=3)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_array_equal(p.data, q.data, err_msg=n)


# Mixed precision against float32, bounds from the compute dtype's unit roundoff u (bf16 2^-8 = 3.9e-3,
# float16 2^-11 = 4.9e-4): the loss is a mean over B T tokens of per-token errors of order u that mostly
# cancel -- within u; the gradients pass through every layer's rounded activations and products, each
# a relative u per term, and the norm of their difference measured 1.1 u (bf16: 4.3e-3) and 1.5 u
# (float16: 7.3e-4) on this model -- within 3 u. A wrong gradient is O(1) off.
@pytest.mark.parametrize("cdt,tol", [("bfloat16", 2.0 ** -8), ("float16", 2.0 ** -11)])
def test_mixed_precision_close_to_float32(cdt, tol):
    cfg = GPTConfig(**MOE)
    m32 = GPT(cfg, seed=0)
    mlp = GPT(cfg, seed=0, compute_dtype=cdt)
    idx, tg = _batch(cfg)
    l32 = m32.loss_and_grad(idx, tg)
    llp = mlp.loss_and_grad(idx, tg)
    assert abs(llp - l32) / l32 < tol
    for (n, p), (_, q) in zip(m32.named_parameters(), mlp.named_parameters()):
        assert q.data.dtype == np.float32 and q.grad.dtype == np.float32, n
    g32 = np.concatenate([p.grad.ravel() for p in m32.parameters()])
    glp = np.concatenate([p.grad.ravel() for p in mlp.parameters()])
    assert rel_err(glp, g32) < 3 * tol
    assert mlp.logits(idx).dtype == np.float32      # the float32 accumulators, unrounded (autocast's CE input)


def test_generate_shapes():
    m = GPT(GPTConfig(**DENSE))
    out = m.generate(np.zeros((2, 1), dtype=np.int64), 10, top_k=5, rng=np.random.default_rng(0))
    assert out.shape == (2, 11) and out.max() < 32


def _train(cfg, steps, B=8, lr=3e-3, seed=0):
    data = np.frombuffer(open(inspect.__file__, "rb").read(), dtype=np.uint8).astype(np.int64)
    rng = np.random.default_rng(seed)
    m = GPT(cfg, seed=seed)
    opt = AdamW(m.named_parameters(), lr=lr, weight_decay=0.1)
    T = cfg.block_size
    losses = []
    for step in range(steps):
        ix = rng.integers(0, len(data) - T - 1, B)
        x = np.stack([data[i:i + T] for i in ix])
        y = np.stack([data[i + 1:i + T + 1] for i in ix])
        m.zero_grad()
        losses.append(m.loss_and_grad(x, y))
        clip_grad_norm(m.parameters(), 1.0)
        opt.step(cosine_lr(step, lr, 10, steps, lr / 10))
        m.update_expert_bias()
    return losses, m


@pytest.mark.parametrize("moe", [False, True])
def test_training_on_text_drives_loss_down(moe):
    extra = dict(n_expert=4, top_k=2, capacity_factor=1.25, bias_update_rate=1e-3) if moe else {}
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32, **extra)
    losses, m = _train(cfg, 150)
    first, last = np.mean(losses[:5]), np.mean(losses[-10:])
    assert first > 5.0, first                        # ~ln(256) at init
    assert last < 2.75, (first, last)                # docs/engine.md: 2.62 dense, 2.67 MoE (seeded)
    if moe:
        stats = m.moe_stats()
        assert len(stats) == 2 and sum(stats[0]["tokens_per_expert"]) == 150 * 8 * 32 * 2
        assert 0 <= stats[0]["dropped_fraction"] < 0.5


def test_precision_resolution_shared_by_gpt_and_tpgpt():
    from pympar.comm import SelfComm
    from pympar.nn.products import resolve_precision
    from pympar.parallel.tp.gpt import TPGPT

    assert resolve_precision(np.float32, None) == (np.float32, None)
    assert resolve_precision("float32", "float32") == (np.float32, None)     # same as master: no casts
    assert resolve_precision(np.float32, "float16")[1] == np.float16
    with pytest.raises(ValueError, match="master dtype float16 is not supported by GPT: use float32 or float64"):
        GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=16, block_size=8), dtype=np.float16)
    with pytest.raises(ValueError, match="not supported by TPGPT"):
        TPGPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=16, block_size=8), SelfComm(), dtype=np.int32)


def test_config_from_dict_keeps_known_fields_and_validates():
    """GPTConfig.from_dict (checkpoint meta, imported config.json): unknown keys are ignored, the
    known ones kept, a bad value refused with the field's name."""
    from dataclasses import asdict

    c = GPTConfig.from_preset("moe-tiny", n_layer=3)
    assert GPTConfig.from_dict({**asdict(c), "written_by": "another tool", "n_future_field": 7}) == c
    with pytest.raises(ValueError, match="n_embd=30 is not divisible by n_head=4"):
        GPTConfig.from_dict({"n_embd": 30, "n_head": 4})


@pytest.mark.parametrize("moe", [False, True])
def test_a_pipeline_stage_is_a_gpt_holding_some_pieces(moe):
    """GPT(..., blocks=, embedding=, head=): two stages hold the whole model's parameters by the
    same names and values, and their stage_forward/stage_backward compute its loss and gradients."""
    from pympar.nn.gpt import GPTParts

    cfg = GPTConfig(vocab_size=29, block_size=8, n_layer=4, n_head=2, n_embd=16,
                    **(dict(n_expert=4, top_k=2) if moe else {}))
    whole = GPT(cfg, seed=3, dtype=np.float64)
    parts = GPTParts(np.float64)
    first = GPT(cfg, 3, parts=parts, blocks=[0, 1], head=False, stage=0)
    last = GPT(cfg, 3, parts=parts, blocks=[2, 3], embedding=False, tied=parts.embedding(cfg, 3), stage=1)
    want = whole.state_dict()
    got = {**first.state_dict(), **last.state_dict()}
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
    assert [i for i, _ in last.moe_layers()] == ([2, 3] if moe else [])
    rng = np.random.default_rng(0)
    idx, tgt = rng.integers(0, 29, size=(2, 8)), rng.integers(0, 29, size=(2, 8))
    loss = whole.loss_and_grad(idx, tgt, grad_scale=1.0)
    x, c0, t0 = first.stage_forward(idx)
    y, c1, t1 = last.stage_forward(x, tgt)
    assert y is None and t0 + t1 == pytest.approx(loss, rel=1e-12)
    assert first.stage_backward(last.stage_backward(None, c1, 1.0), c0, 1.0) is None
    grads = {n: p.grad for m in (first, last) for n, p in m.named_parameters()}
    for n, p in whole.named_parameters():
        if n != "transformer.wte.weight":                 # the tied wte: its two parts add up (below)
            np.testing.assert_allclose(grads[n], p.grad, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(first.embedding.wte.grad + last.head.wte.grad, whole.embedding.wte.grad, rtol=1e-9,
                               atol=1e-12)
    with pytest.raises(ValueError, match="this GPT is pipeline stage 1"):
        last.loss_and_grad(idx, tgt)
    with pytest.raises(ValueError, match="needs tied="):
        GPT(cfg, blocks=[3], embedding=False)
