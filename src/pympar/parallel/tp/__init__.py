"""Megatron-style tensor parallelism over a tp Communicator.

Layout: attention c_attn column-parallel by heads (a non-contiguous Shard of [q; k; v]),
c_proj row-parallel; MLP c_fc column-parallel, c_proj row-parallel: two allreduces per block
in forward, two in backward. Vocab-parallel token embedding and fused cross-entropy (the vocab
padded to a multiple of tp, never gathering full logits). MoE experts are split along their
hidden width (all experts on every tp rank; routing replicated). Optional sequence parallelism.
Mixed precision (``compute_dtype``) as in pympar.nn, partial sums over tp reduced in float32.

Entry points: ``TPGPT(config, tp_comm, seed, dtype, sequence_parallel=False, compute_dtype=None)``
(an nn.GPT made of ``TPParts``, the parts a tensor-parallel pipeline stage is made of too),
``validate_tp(config, tp, sequence_parallel, seq_len)`` (no communication), and the layers.
"""
from .attention import TPCausalSelfAttention
from .block import TPBlock
from .collectives import TPCollectives, as_collectives
from .cross_entropy import (VocabParallelHead, vocab_parallel_cross_entropy_backward,
                            vocab_parallel_cross_entropy_forward)
from .embedding import VocabParallelEmbedding
from .gpt import SPGradSync, TPGPT, TPParts, activation_bytes, apply_tp
from .linear import ColumnParallelLinear, RowParallelLinear
from .mlp import TPMLP
from .moe import TPMoE
from .validate import validate_tp

__all__ = ["TPGPT", "TPParts", "apply_tp", "TPBlock", "TPCausalSelfAttention", "TPMLP", "TPMoE", "ColumnParallelLinear",
           "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelHead",
           "vocab_parallel_cross_entropy_forward", "vocab_parallel_cross_entropy_backward",
           "TPCollectives", "as_collectives", "SPGradSync", "validate_tp", "activation_bytes"]
