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

import contextlib

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
    """Per block the keys and values of the positions seen so far, (B, nh, block_size, hs) each,
    nh the heads the block's attention computes on this process (all of them; a tensor-parallel
    rank's share). Blocks are keyed by identity: any list of a model's blocks (a pipeline stage's)."""

    def __init__(self, B, block_size):
        self.B, self.block_size = B, block_size
        self.k, self.v = {}, {}

    def _of(self, b, like):
        kv = self.k.get(id(b))
        if kv is None:
            attn = b.attn
            nh = getattr(attn, "n_head_local", None) or attn.n_head
            hs = getattr(attn, "head_size", None) or attn.c_attn.weight.data.shape[1] // attn.n_head
            xp = xp_of(like)
            self.k[id(b)] = kv = xp.zeros((self.B, nh, self.block_size, hs), like.dtype)
            self.v[id(b)] = xp.zeros_like(kv)
        return kv, self.v[id(b)]

    def run(self, blocks, x, t0):
        """x (B, s, C) at positions t0..t0+s-1 through ``blocks``; each block's new keys and values
        join its cache. -> (B, s, C)."""
        xp = xp_of(x)
        B, s, _ = x.shape
        t1 = t0 + s
        causal = xp.tril(xp.ones((s, t1), bool), k=t0)          # new position i sees cache 0..t0+i
        for b in blocks:
            K_all, V_all = self._of(b, x)
            nh, hs = K_all.shape[1], K_all.shape[3]
            scale = float(1.0 / np.sqrt(hs))    # a Python float: the product stays in the activations' dtype
            h, _ = b.ln_1.forward(x)
            qkv, _ = b.attn.c_attn.forward(h)
            C = nh * hs                                             # c_attn's output: q | k | v
            q, k, v = (qkv[..., j * C:(j + 1) * C].reshape(B, s, nh, hs).transpose(0, 2, 1, 3)
                       for j in range(3))
            K_all[:, :, t0:t1] = k
            V_all[:, :, t0:t1] = v
            K, V = K_all[:, :, :t1], V_all[:, :, :t1]
            att = (q @ K.transpose(0, 1, 3, 2)) * scale               # (B, nh, s, t1)
            att = xp.where(causal, att, -xp.inf)
            att = xp.exp(att - att.max(axis=-1, keepdims=True))
            att /= att.sum(axis=-1, keepdims=True)
            y = (att @ V).transpose(0, 2, 1, 3).reshape(B, s, C)
            y, _ = b.attn.c_proj.forward(y)                           # (tensor parallel: its allreduce)
            x = x + y
            h2, _ = b.ln_2.forward(x)
            f, _ = b.ffn.forward(h2)
            x = x + f
        return x


def embed(embedding, tokens, t0):
    """The embedding's output for tokens (B, s) at positions t0..t0+s-1 (any embedding module with
    ``positions``: nn's and the tensor-parallel one)."""
    xp = xp_of(embedding.wte.data)
    old = embedding.positions
    embedding.positions = xp.arange(t0, t0 + tokens.shape[1])
    try:
        x, _ = embedding.forward(xp.asarray(tokens))
    finally:
        embedding.positions = old
    return x


class Decoder:
    """Incremental decoding of a model whose ``embedding``, ``h`` and ``head`` are on this process
    (nn.GPT, or a tensor-parallel rank's TPGPT: its collectives run inside the modules)."""

    def __init__(self, model, B):
        self.model, self.B = model, B
        self.block_size = model.config.block_size
        self.reset()

    def reset(self):
        self.kv, self.t = KVCache(self.B, self.block_size), 0

    def step(self, tokens):
        """tokens (B, s) at the next s positions -> last-position logits (B, V), or None on a
        process that does not compute them (a pipeline rank without the last stage)."""
        m = self.model
        x = self.kv.run(m.h, embed(m.embedding, tokens, self.t), self.t)
        self.t += tokens.shape[1]
        return m.head.logits(x[:, -1:])[:, -1]

    def agree(self, tokens):
        """The sampled tokens (B, 1), the same on every process of the model (a pipeline sends the
        last stage's to the others); here: as they are."""
        return tokens


def decode(dec, idx, n, top_k=None, temperature=1.0, rng=None):
    """Append n tokens to idx (B, T) with Decoder ``dec``: prefill the last block_size positions,
    then one position per token; once the sequence fills the window, the window slides and runs
    again (positions shift under every cached key)."""
    rng = np.random.default_rng(0) if rng is None else rng
    idx = np.asarray(to_numpy(idx))
    bs = dec.block_size
    dec.reset()
    lg = dec.step(idx[:, -bs:])
    for i in range(n):
        nxt = dec.agree(sample(lg, top_k, temperature, rng) if lg is not None else None)
        idx = np.concatenate([idx, nxt], axis=1)
        if i == n - 1:
            break
        if dec.t < bs:
            lg = dec.step(nxt)
        else:                         # the window slides: every position moves, run it again
            dec.reset()
            lg = dec.step(idx[:, -bs:])
    return idx


@contextlib.contextmanager
def moe_inference(model):
    """Context: the model's MoE layers do not count expert loads (inference is not training)."""
    layers = [m for _, m in model.moe_layers()]
    was = [m.recording for m in layers]
    for m in layers:
        m.recording = False
    try:
        yield
    finally:
        for m, r in zip(layers, was):
            m.recording = r


def generate(model, idx, n, top_k=None, temperature=1.0, rng=None, cache=True):
    """Append n tokens to idx (B, T); the same draws as GPT.generate (see the module docstring)."""
    if not cache:
        return model.generate(idx, n, top_k=top_k, rng=rng, temperature=temperature)
    with moe_inference(model):
        return decode(Decoder(model, np.shape(idx)[0]), idx, n, top_k, temperature, rng)
