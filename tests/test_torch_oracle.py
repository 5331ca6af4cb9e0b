"""pympar against PyTorch autograd on the same weights.

Committed fixtures (made by tests/make_fixtures.py) run without torch; the live comparisons
skip when torch is absent.
"""
import glob
import json
import os

import numpy as np
import pytest
from nn_check import rel_err

from pympar.nn import GPT, GPTConfig

FIXTURES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "fixtures", "*.npz")))


def test_fixtures_exist_and_are_small():
    assert len(FIXTURES) >= 3
    assert sum(os.path.getsize(f) for f in FIXTURES) < 200_000


@pytest.mark.parametrize("path", FIXTURES, ids=os.path.basename)
def test_matches_pytorch_fixture(path):
    f = np.load(path)
    cfg = GPTConfig(**json.loads(str(f["config"])))
    m = GPT(cfg, seed=0, dtype=np.float64)
    m.load_state_dict({k[len("param/"):]: f[k] for k in f.files if k.startswith("param/")})
    idx, tg = f["idx"], f["targets"]
    assert rel_err(m.logits(idx), f["logits"]) < 1e-10
    m.zero_grad()
    loss = m.loss_and_grad(idx, tg)
    assert abs(loss - float(f["loss"])) < 1e-10 * abs(float(f["loss"]))
    grads = {k[len("grad/"):]: f[k] for k in f.files if k.startswith("grad/")}
    own = dict(m.named_parameters())
    assert set(grads) - {"lm_head.weight"} == set(own)
    errs = {n: rel_err(p.grad, grads[n]) for n, p in own.items()}
    assert max(errs.values()) < 1e-8, {n: e for n, e in errs.items() if e >= 1e-8}


# --- live comparisons ---------------------------------------------------------------------------
BASE = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
LIVE = {
    "dense": BASE,
    "moe_k1_dropless": dict(BASE, n_expert=4, top_k=1),
    "moe_k2_capacity": dict(BASE, n_expert=4, top_k=2, capacity_factor=1.0, shared_expert=True),
    "moe_k2_every2": dict(BASE, n_expert=4, top_k=2, moe_every=2, capacity_factor=0.75),
}


def _both(name, dtype, seed=0):
    torch = pytest.importorskip("torch")
    from torch_ref import TorchGPT, load_numpy_state

    cfg = GPTConfig(**LIVE[name])
    m = GPT(cfg, seed=seed, dtype=dtype)
    t = TorchGPT(cfg).to(torch.float64 if dtype == np.float64 else torch.float32)
    load_numpy_state(t, m.state_dict())
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, cfg.vocab_size, (3, cfg.block_size))
    tg = rng.integers(0, cfg.vocab_size, (3, cfg.block_size))
    return torch, m, t, idx, tg


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-8), (np.float32, 1e-4)], ids=["f64", "f32"])
@pytest.mark.parametrize("name", list(LIVE))
def test_grads_match_pytorch_autograd(name, dtype, tol):
    torch, m, t, idx, tg = _both(name, dtype)
    _, tloss = t(torch.tensor(idx), torch.tensor(tg))
    tloss.backward()
    loss = m.loss_and_grad(idx, tg)
    assert abs(loss - tloss.item()) < tol * abs(tloss.item())
    from torch_ref import numpy_grads

    tg_ = numpy_grads(t)
    errs = {n: rel_err(p.grad, tg_[n]) for n, p in m.named_parameters()}
    assert max(errs.values()) < tol, {n: e for n, e in errs.items() if e >= tol}


@pytest.mark.parametrize("name", ["dense", "moe_k2_capacity"])
def test_state_dict_into_pytorch_gives_same_logits_and_loss(name):
    torch, m, t, idx, tg = _both(name, np.float32, seed=3)
    # train pympar a little so the exported weights are not the initial ones
    from pympar.optim import AdamW

    opt = AdamW(m.named_parameters(), lr=1e-2)
    for _ in range(3):
        m.zero_grad()
        m.loss_and_grad(idx, tg)
        opt.step()
    from torch_ref import TorchGPT, load_numpy_state

    t = TorchGPT(m.config).float()
    load_numpy_state(t, m.state_dict())
    with torch.no_grad():
        logits, loss = t(torch.tensor(idx), torch.tensor(tg))
    assert rel_err(m.logits(idx), logits.numpy()) < 1e-5
    assert abs(m.forward_loss(idx, tg) - loss.item()) < 1e-5 * loss.item()
