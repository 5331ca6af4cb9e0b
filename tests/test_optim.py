"""AdamW against torch.optim.AdamW, clipping, the schedule, the loss scaler."""
import math

import numpy as np
import pytest

from pympar.nn import GPT, GPTConfig, Parameter
from pympar.optim import AdamW, DynamicLossScaler, clip_grad_norm, cosine_lr, decays


def test_decay_groups():
    m = GPT(GPTConfig(n_expert=2, top_k=1))
    opt = AdamW(m.named_parameters())
    no = sorted(n for n, d in opt.decay.items() if not d)
    assert "transformer.wte.weight" in no and "transformer.wpe.weight" in no
    assert all(n.endswith(("bias", "wte.weight", "wpe.weight")) or ".ln_" in n for n in no)
    assert opt.decay["transformer.h.0.attn.c_attn.weight"]
    assert opt.decay["transformer.h.0.moe.router.weight"]


def test_adamw_matches_torch():
    torch = pytest.importorskip("torch")
    m = GPT(GPTConfig(vocab_size=32, block_size=8, n_embd=8), seed=0, dtype=np.float64)
    named = list(m.named_parameters())
    tp = {n: torch.nn.Parameter(torch.tensor(p.data.copy())) for n, p in named}
    decay = [tp[n] for n, p in named if decays(n, p.data)]
    nodecay = [tp[n] for n, p in named if not decays(n, p.data)]
    topt = torch.optim.AdamW([dict(params=decay, weight_decay=0.1), dict(params=nodecay, weight_decay=0.0)],
                             lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    opt = AdamW(named, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    rng = np.random.default_rng(0)
    for step in range(5):
        lr = 1e-2 * (0.5 + step / 10)
        for n, p in named:
            g = rng.standard_normal(p.data.shape)
            p.grad[...] = g
            tp[n].grad = torch.tensor(g)
        for grp in topt.param_groups:
            grp["lr"] = lr
        topt.step()
        opt.step(lr=lr)
    for n, p in named:
        np.testing.assert_allclose(p.data, tp[n].detach().numpy(), rtol=1e-10, atol=1e-12, err_msg=n)


def test_adamw_state_roundtrip():
    p = Parameter(np.ones((2, 3)))
    a = AdamW([("w", p)], lr=0.1)
    p.grad[...] = 1.0
    a.step()
    b = AdamW([("w", Parameter(p.data.copy()))], lr=0.1)
    b.load_state_dict(a.state_dict())
    assert b.step_count == 1
    np.testing.assert_array_equal(b.m["w"], a.m["w"])
    with pytest.raises(ValueError, match="names differ"):
        AdamW([("x", Parameter(np.ones(2)))]).load_state_dict(a.state_dict())


def test_clip_grad_norm():
    a, b = Parameter(np.zeros(3)), Parameter(np.zeros((2, 2)))
    a.grad[...] = [3.0, 0.0, 0.0]
    b.grad[...] = [[0.0, 4.0], [0.0, 0.0]]
    assert clip_grad_norm([a, b], 10.0) == pytest.approx(5.0)
    np.testing.assert_array_equal(a.grad, [3.0, 0, 0])          # under the limit: untouched
    assert clip_grad_norm([a, b], 1.0) == pytest.approx(5.0)
    total = math.sqrt((a.grad ** 2).sum() + (b.grad ** 2).sum())
    assert total == pytest.approx(1.0, rel=1e-5)
    # the hook sees the local sum of squares and its answer is the global one
    seen = []
    a.grad[...] = [3.0, 0, 0]
    b.grad[...] = 0
    norm = clip_grad_norm([a, b], 100.0, allreduce_sq=lambda s: seen.append(s) or 4 * s)
    assert seen == [pytest.approx(9.0)] and norm == pytest.approx(6.0)


def test_cosine_lr():
    assert cosine_lr(0, 1.0, 10, 100, 0.1) == pytest.approx(0.1)
    assert cosine_lr(9, 1.0, 10, 100, 0.1) == pytest.approx(1.0)
    assert cosine_lr(10, 1.0, 10, 100, 0.1) == pytest.approx(1.0)
    assert cosine_lr(55, 1.0, 10, 100, 0.1) == pytest.approx(0.55)
    assert cosine_lr(100, 1.0, 10, 100, 0.1) == pytest.approx(0.1)
    assert cosine_lr(500, 1.0, 10, 100, 0.1) == pytest.approx(0.1)
    lrs = [cosine_lr(s, 1.0, 10, 100, 0.1) for s in range(10, 100)]
    assert all(x >= y for x, y in zip(lrs, lrs[1:]))


def test_loss_scaler_skip_and_grow():
    s = DynamicLossScaler(init_scale=1024.0, growth_interval=3)
    p = Parameter(np.zeros(4, np.float32))
    assert not s.found_inf([p])
    p.grad[2] = np.inf
    assert s.found_inf([p])
    assert s.update(True) is True and s.scale == 512.0
    assert s.update(False) is False and s.update(False) is False and s.scale == 512.0
    assert s.update(False) is False and s.scale == 1024.0      # grew after 3 good steps
    p.grad[2] = np.nan
    assert s.found_inf([p]) and s.update(True) and s.scale == 512.0 and s.good_steps == 0


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_float16_training_with_loss_scaler_skips_overflow():
    cfg = GPTConfig(vocab_size=32, block_size=8, n_embd=16)
    m = GPT(cfg, seed=0, compute_dtype="float16")
    opt = AdamW(m.named_parameters(), lr=1e-2)
    s = DynamicLossScaler(init_scale=2.0 ** 30, growth_interval=2)   # overflows float16 at first
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 32, (4, 8))
    tg = (idx + 1) % 32
    before = m.state_dict()
    skipped = 0
    losses = []
    for _ in range(40):
        m.zero_grad()
        losses.append(m.loss_and_grad(idx, tg, grad_scale=s.scale))
        scale = s.scale
        if s.update(s.found_inf(m.parameters())):
            skipped += 1
            continue
        for p in m.parameters():
            p.grad /= scale
        opt.step()
    assert skipped >= 1 and s.scale < 2.0 ** 30
    assert any(not np.array_equal(before[n], p.data) for n, p in m.named_parameters())
    assert losses[-1] < losses[0] - 0.5
