"""Autoregressive generation with a key/value cache: each new token costs one position.

``generate(model, idx, n, top_k, temperature, rng, cache=True)`` appends n tokens to idx
(B, T), sampling as ``GPT.generate`` does (the same draws from the same rng, so a seed gives
the same tokens either way, and ``top_k=1`` is greedy). With the cache, the prompt runs through
the blocks once (prefill) and every later token runs the blocks on its own position: per
layer the new token's key and value are appended to the cache and its query attends over the
cache. The model's own modules compute everything but the attention of the new position
(LayerNorm, the projections, MLP or MoE, the tied head). Once the sequence is longer than
block_size, the window slides: positions shift under every cached key, so each step runs the
window again (what the uncached path does at every step).

    qkv (B, 1, 3C) -> q, k, v (B, nh, 1, hs); K, V (B, nh, t, hs) with this position appended
    att = softmax(q K^T / sqrt(hs)) (B, nh, 1, t); y = att V -> (B, 1, C) -> c_proj
"""
from __future__ import annotations

import numpy as np

from ..backend import to_numpy, xp_of


def sample(lg, top_k, temperature, rng):
    """Next tokens (B, 1) from last-position logits lg (B, V): temperature, top-k, one draw each."""
    lg = to_numpy(lg).astype(np.float64) / temperature
    if top_k is not None:
        kth = np.sort(lg, axis=-1)[:, -min(top_k, lg.shape[-1])][:, None]
        lg = np.where(lg < kth, -np.inf, lg)
    p = np.exp(lg - lg.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.array([rng.choice(p.shape[-1], p=row) for row in p])[:, None]


class KVCache:
    """Per layer the keys and values of the positions seen so far, (B, nh, t, hs) each."""

    def __init__(self, model, B):
        c = model.config
        self.nh, self.hs = c.n_head, c.n_embd // c.n_head
        xp = xp_of(model.embedding.wte.data)
        dt = model.embedding.wte.data.dtype
        self.k = [xp.zeros((B, self.nh, c.block_size, self.hs), dt) for _ in model.h]
        self.v = [xp.zeros((B, self.nh, c.block_size, self.hs), dt) for _ in model.h]
        self.t = 0

    def step(self, model, tokens):
        """Run tokens (B, s) at positions t..t+s-1 through the model; -> logits of the last (B, V)."""
        xp = xp_of(model.embedding.wte.data)
        B, s = tokens.shape
        t0, t1 = self.t, self.t + s
        emb = model.embedding
        x = emb.wte.data[tokens] + emb.wpe.data[t0:t1]
        scale = float(1.0 / np.sqrt(self.hs))   # a Python float: the product stays in the activations' dtype
        causal = xp.tril(xp.ones((s, t1), bool), k=t0)          # new position i sees cache 0..t0+i
        for li, b in enumerate(model.h):
            h, _ = b.ln_1.forward(x)
            qkv, _ = b.attn.c_attn.forward(h)
            C = self.nh * self.hs                                   # c_attn's output: q | k | v
            q, k, v = (qkv[..., j * C:(j + 1) * C].reshape(B, s, self.nh, self.hs).transpose(0, 2, 1, 3)
                       for j in range(3))
            self.k[li][:, :, t0:t1] = k
            self.v[li][:, :, t0:t1] = v
            K, V = self.k[li][:, :, :t1], self.v[li][:, :, :t1]
            att = (q @ K.transpose(0, 1, 3, 2)) * scale               # (B, nh, s, t1)
            att = xp.where(causal, att, -xp.inf)
            att = xp.exp(att - att.max(axis=-1, keepdims=True))
            att /= att.sum(axis=-1, keepdims=True)
            y = (att @ V).transpose(0, 2, 1, 3).reshape(B, s, self.nh * self.hs)
            y, _ = b.attn.c_proj.forward(y)
            x = x + y
            h2, _ = b.ln_2.forward(x)
            f, _ = b.ffn.forward(h2)
            x = x + f
        self.t = t1
        return model.head.logits(x[:, -1:])[:, -1]


def generate(model, idx, n, top_k=None, temperature=1.0, rng=None, cache=True):
    """Append n tokens to idx (B, T); the same draws as GPT.generate (see the module docstring)."""
    if not cache:
        return model.generate(idx, n, top_k=top_k, rng=rng, temperature=temperature)
    rng = np.random.default_rng(0) if rng is None else rng
    idx = np.asarray(to_numpy(idx))
    bs = model.config.block_size
    xp = xp_of(model.embedding.wte.data)
    layers = [m for _, m in model.moe_layers()]
    for m in layers:
        m.recording = False           # inference: expert loads are not training statistics
    try:
        kv = KVCache(model, idx.shape[0])
        lg = kv.step(model, xp.asarray(idx[:, -bs:]))
        for i in range(n):
            nxt = sample(lg, top_k, temperature, rng)
            idx = np.concatenate([idx, nxt], axis=1)
            if i == n - 1:
                break
            if kv.t < bs:
                lg = kv.step(model, xp.asarray(nxt))
            else:                     # the window slides: every position moves, run it again
                kv = KVCache(model, idx.shape[0])
                lg = kv.step(model, xp.asarray(idx[:, -bs:]))
    finally:
        for m in layers:
            m.recording = True
    return idx
