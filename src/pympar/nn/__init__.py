"""Explicit forward/backward modules (no tape): layers, attention, MoE and the GPT.

Convention: ``forward(x) -> (y, ctx)``, ``backward(dy, ctx) -> dx``; parameter grads
accumulate (+=), activation grads are returned fresh (=). See parameter.py (and wgrad.py).

The applications (pympar.config.apply_environment) ask glibc to keep freed memory
(pympar/kernels/malloc_policy.py): a step's activations are then reused instead of page-faulted in
again; a program of its own calls ``pympar.kernels.malloc_policy.retain_freed_memory()``.
"""
from .attention import CausalSelfAttention
from .config import PRESETS, GPTConfig
from .gpt import GPT, Block, Head
from .layers import MLP, Embedding, LayerNorm, Linear
from .moe import MoE
from .parameter import Parameter, default_std, init_param
from .module import Module


__all__ = ["GPT", "GPTConfig", "PRESETS", "Block", "Head", "Embedding", "Linear", "LayerNorm",
           "MLP", "CausalSelfAttention", "MoE", "Module", "Parameter", "init_param", "default_std"]
