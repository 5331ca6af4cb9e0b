"""GPTConfig: one dataclass for dense and Mixture-of-Experts GPTs, plus named presets."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields, replace

import numpy as np


MAX_LAYERS = 100_000          # far beyond any model (GPT-3: 96), far below what a loop over them notices
MAX_EXPERTS = 1 << 20


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    bias: bool = True
    # Mixture of Experts (n_expert = 0: dense)
    n_expert: int = 0
    moe_every: int = 1          # every k-th block is MoE: block indices k-1, 2k-1, ...
    top_k: int = 2
    capacity_factor: float = 0.0  # 0 = dropless
    aux_coef: float = 0.01
    z_coef: float = 0.001
    shared_expert: bool = False
    bias_update_rate: float = 0.0  # aux-loss-free balancing; 0 = off
    ln_eps: float = 1e-5

    def validate(self) -> "GPTConfig":
        """Raise ValueError naming the bad field and what would be right; return self. Every field
        of its type (an int field an integer, a float field a finite number, a bool a boolean: the
        values may come from files), and no more layers or experts than MAX_LAYERS, MAX_EXPERTS
        (every count is looped over before anything is allocated)."""
        for f in fields(self):
            v, t = getattr(self, f.name), f.type
            ok = {"int": isinstance(v, numbers.Integral) and not isinstance(v, bool),
                  "bool": isinstance(v, (bool, np.bool_)),
                  "float": isinstance(v, numbers.Real) and not isinstance(v, bool) and -math.inf < v < math.inf}.get(t, True)
            if not ok:
                raise ValueError(f"{f.name}={v!r} must be {dict(int='an integer', bool='true or false').get(t, 'a finite number')}")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name, most in (("n_layer", MAX_LAYERS), ("n_expert", MAX_EXPERTS)):
            if getattr(self, name) > most:
                raise ValueError(f"{name}={getattr(self, name)} must be <= {most}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.n_expert < 0:
            raise ValueError(f"n_expert={self.n_expert} must be >= 0 (0 = dense)")
        if self.n_expert:
            if not 1 <= self.top_k <= self.n_expert:
                raise ValueError(f"top_k={self.top_k} must be in 1..n_expert={self.n_expert}")
            if self.moe_every < 1:
                raise ValueError(f"moe_every={self.moe_every} must be >= 1")
            if not 0 <= self.capacity_factor <= self.n_expert:
                raise ValueError(f"capacity_factor={self.capacity_factor} must be in 0..n_expert={self.n_expert} "
                                 f"(0 = dropless; n_expert already holds every token at every expert)")
            for name in ("aux_coef", "z_coef"):
                if not 0 <= getattr(self, name) < float("inf"):
                    raise ValueError(f"{name}={getattr(self, name)} must be a finite number >= 0")
            if self.bias_update_rate < 0:
                raise ValueError(f"bias_update_rate={self.bias_update_rate} must be >= 0")
        if self.ln_eps <= 0:
            raise ValueError(f"ln_eps={self.ln_eps} must be > 0")
        return self

    def is_moe_block(self, i: int) -> bool:
        return self.n_expert > 0 and (i + 1) % self.moe_every == 0

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        """The config a dict records (a checkpoint's meta, an import's config.json): its GPTConfig
        fields, validated; other keys are ignored (records written by other tools, or by a later
        pympar with fields this one lacks). TypeError/ValueError when a field is bad."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known}).validate()

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "GPTConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}: expected one of {sorted(PRESETS)}")
        known = {f.name for f in fields(cls)}
        bad = sorted(set(overrides) - known)
        if bad:
            raise ValueError(f"unknown GPTConfig fields {bad}: expected some of {sorted(known)}")
        return replace(cls(**PRESETS[name]), **overrides).validate()


PRESETS = {
    "tiny": dict(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32),
    "small": dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128),
    "gpt2-124m": dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "moe-tiny": dict(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32,
                     n_expert=4, top_k=2, moe_every=1),
    "moe-small": dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128,
                      n_expert=8, top_k=2, moe_every=2, capacity_factor=1.25),
}


def weight_elements(cfg) -> int:
    """Elements of the model's embeddings and weight matrices (biases and norms not counted): a lower
    bound of its parameter count, from the config alone, before anything is allocated. Loaders check
    a config from a file against the elements the file holds with it."""
    C, n = cfg.n_embd, (cfg.vocab_size + cfg.block_size) * cfg.n_embd
    for i in range(cfg.n_layer):
        n += 4 * C * C
        if cfg.is_moe_block(i):
            n += cfg.n_expert * (8 * C * C + C) + (8 * C * C if getattr(cfg, "shared_expert", False) else 0)
        else:
            n += 8 * C * C
    return n


def matmul_params_per_token(cfg) -> int:
    """N_matmul of pympar/metrics.py's docstring: weights one token multiplies by (active only)."""
    C = cfg.n_embd
    n = 0
    for i in range(cfg.n_layer):
        n += 4 * C * C
        if cfg.is_moe_block(i):
            n += cfg.top_k * 8 * C * C + C * cfg.n_expert
            if getattr(cfg, "shared_expert", False):
                n += 8 * C * C
        else:
            n += 8 * C * C
    return n + cfg.vocab_size * C


def flops_per_token(cfg) -> float:
    """Training FLOPs per token (forward + backward), PaLM's count; see pympar/metrics.py's docstring."""
    return 6.0 * matmul_params_per_token(cfg) + 12.0 * cfg.n_layer * cfg.block_size * cfg.n_embd
