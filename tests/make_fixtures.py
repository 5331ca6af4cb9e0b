"""Make the committed PyTorch reference fixtures (tests/fixtures/*.npz). Run from the repo root:

    python tests/make_fixtures.py

Each fixture: a tiny GPT (dense or MoE) built and initialised by PyTorch in float64, a batch,
and what PyTorch autograd computes: logits, loss, every parameter gradient. The test
tests/test_torch_oracle.py loads the weights into pympar and compares, with no torch needed.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from torch_ref import TorchGPT, numpy_grads, numpy_state  # noqa: E402

from pympar.nn import GPTConfig  # noqa: E402  (the dataclass only: no pympar math here)

BASE = dict(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8)
FIXTURES = {
    "gpt_dense": dict(BASE),
    # k=2 with drops, a shared expert and a selection bias; first block dense (moe_every=2)
    "gpt_moe_k2": dict(BASE, n_expert=3, top_k=2, capacity_factor=1.0, shared_expert=True,
                       aux_coef=0.05, z_coef=0.01, moe_every=2),
    "gpt_moe_k1": dict(BASE, n_layer=1, n_expert=3, top_k=1, capacity_factor=0.0),
}
HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


def make(name, kwargs, seed=1234):
    cfg = GPTConfig(**kwargs).validate()
    torch.manual_seed(seed)
    model = TorchGPT(cfg).double()
    with torch.no_grad():   # move off the plain init so every parameter matters
        for n, p in model.named_parameters():
            p.add_(0.2 * torch.randn_like(p))
        for b in model.transformer.h:
            if b.is_moe:
                b.moe.expert_bias.copy_(0.01 * torch.randn_like(b.moe.expert_bias))
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=g)
    tg = torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=g)
    tg[1, 2] = -1
    logits, loss = model(idx, tg)
    loss.backward()
    out = {f"param/{k}": v for k, v in numpy_state(model).items()}
    out.update({f"grad/{k}": v for k, v in numpy_grads(model).items()})
    out.update(idx=idx.numpy(), targets=tg.numpy(), logits=logits.detach().numpy(),
               loss=np.array(loss.item()), config=np.array(json.dumps(asdict(cfg))))
    os.makedirs(HERE, exist_ok=True)
    path = os.path.join(HERE, f"{name}.npz")
    np.savez_compressed(path, **out)
    print(f"{path}: loss {loss.item():.6f}, {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    torch.set_num_threads(1)
    for name, kw in FIXTURES.items():
        make(name, kw)
