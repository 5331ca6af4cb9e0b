"""A PyTorch nanoGPT-style GPT with the same MoE as pympar: the test oracle (tests only).

Same parameter names as pympar (transformer.wte.weight, ...). The routing follows
pympar/nn/moe.py's documented rules: float32+ softmax router, top-k on probs + expert_bias,
gates renormalised when k > 1, choice-major capacity priority, aux and z losses.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.bias)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        self.n_head = c.n_head
        self.sdpa = False                         # use_sdpa(model): F.scaled_dot_product_attention

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        hs = C // self.n_head
        q, k, v = (t.view(B, T, self.n_head, hs).transpose(1, 2) for t in (q, k, v))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


def use_sdpa(model, flag=True):
    """Attention of every block through F.scaled_dot_product_attention (what a PyTorch user runs)
    instead of the hand-written softmax(q k^T) v."""
    for m in model.modules():
        if isinstance(m, CausalSelfAttention):
            m.sdpa = flag
    return model


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd, bias=c.bias)
        self.c_proj = nn.Linear(4 * c.n_embd, c.n_embd, bias=c.bias)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class MoE(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.router = nn.Linear(c.n_embd, c.n_expert, bias=False)
        self.experts = nn.ModuleList(MLP(c) for _ in range(c.n_expert))
        self.shared = MLP(c) if c.shared_expert else None
        self.register_buffer("expert_bias", torch.zeros(c.n_expert))
        self.c = c

    def forward(self, x):
        B, T, C = x.shape
        E, k, c = self.c.n_expert, self.c.top_k, self.c
        N = B * T
        xf = x.reshape(N, C)
        logits = self.router(xf)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        probs = logits.softmax(dim=-1)
        lse = torch.logsumexp(logits, dim=-1)
        idx = torch.topk(probs.detach() + self.expert_bias.to(probs.dtype), k, dim=-1).indices
        psel = probs.gather(1, idx)
        gates = psel / psel.sum(dim=-1, keepdim=True) if k > 1 else psel
        a_expert = idx.T.reshape(-1)                       # choice-major priority
        a_token = torch.arange(N).repeat(k)
        a_gate = gates.T.reshape(-1)
        onehot = F.one_hot(a_expert, E)
        pos = (onehot.cumsum(0) - onehot)[torch.arange(k * N), a_expert]
        cap = math.ceil(k * N * c.capacity_factor / E) if c.capacity_factor > 0 else 0
        keep = pos < cap if cap > 0 else torch.ones_like(pos, dtype=torch.bool)
        y = torch.zeros_like(xf)
        for e in range(E):
            sel = (a_expert == e) & keep
            tok = a_token[sel]
            if tok.numel():
                out = self.experts[e](xf[tok]) * a_gate[sel][:, None].to(xf.dtype)
                y = y.index_add(0, tok, out)
        if self.shared is not None:
            y = y + self.shared(xf)
        f = onehot.sum(0).to(probs.dtype) / (N * k)
        aux = c.aux_coef * E * (f * probs.mean(0)).sum()
        z = c.z_coef * (lse * lse).mean()
        return y.view(B, T, C), aux + z


class Block(nn.Module):
    def __init__(self, c, i):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.n_embd, eps=c.ln_eps, bias=c.bias)
        self.attn = CausalSelfAttention(c)
        self.ln_2 = nn.LayerNorm(c.n_embd, eps=c.ln_eps, bias=c.bias)
        self.is_moe = c.n_expert > 0 and (i + 1) % c.moe_every == 0
        if self.is_moe:
            self.moe = MoE(c)
        else:
            self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        if self.is_moe:
            f, aux = self.moe(self.ln_2(x))
        else:
            f, aux = self.mlp(self.ln_2(x)), 0.0
        return x + f, aux


class TorchGPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.config = c
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c.vocab_size, c.n_embd),
            wpe=nn.Embedding(c.block_size, c.n_embd),
            h=nn.ModuleList(Block(c, i) for i in range(c.n_layer)),
            ln_f=nn.LayerNorm(c.n_embd, eps=c.ln_eps, bias=c.bias)))
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight   # tied

    def forward(self, idx, targets=None):
        B, T = idx.shape
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(T))
        aux = 0.0
        for b in self.transformer.h:
            x, a = b(x)
            aux = aux + a
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float() if logits.dtype != torch.float64
                             else logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, ce + aux


def load_numpy_state(model: TorchGPT, sd: dict):
    """Load a pympar state_dict (numpy arrays, no lm_head.weight) into the torch model."""
    dt = next(model.parameters()).dtype
    full = {k: torch.tensor(v, dtype=dt if v.dtype.kind == "f" else None) for k, v in sd.items()}
    full["lm_head.weight"] = full["transformer.wte.weight"]
    own = model.state_dict()
    for k, v in own.items():   # buffers keep the model dtype
        if k in full and "expert_bias" in k:
            full[k] = full[k].to(v.dtype)
    model.load_state_dict(full, strict=True)


def numpy_state(model: TorchGPT) -> dict:
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()
            if k != "lm_head.weight"}


def numpy_grads(model: TorchGPT) -> dict:
    return {k: p.grad.detach().cpu().numpy().copy() for k, p in model.named_parameters()
            if p.grad is not None}
