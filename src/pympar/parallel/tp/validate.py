"""Validation of a tensor-parallel layout: pure arithmetic, NO communication, so every rank
raises the same ValueError before the first collective."""
from __future__ import annotations


def validate_tp(config, tp: int, sequence_parallel: bool = False, seq_len=None):
    """Raise ValueError naming what is wrong with (config, tp) and what would be right.

    ``seq_len``: the sequence length T of the batches, checked only with sequence parallelism
    (T must split into tp equal parts). Returns config.
    """
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r} must be an integer >= 1")
    config.validate()
    if config.n_head % tp:
        ok = [d for d in range(1, config.n_head + 1) if config.n_head % d == 0]
        raise ValueError(f"n_head={config.n_head} is not divisible by tp={tp}: attention is split by heads; "
                         f"use tp in {ok}")
    if (4 * config.n_embd) % tp:
        raise ValueError(f"the MLP width 4*n_embd={4 * config.n_embd} is not divisible by tp={tp}")
    if sequence_parallel and seq_len is not None and seq_len % tp:
        raise ValueError(f"sequence length T={seq_len} is not divisible by tp={tp}: sequence parallelism "
                         f"splits every sequence into tp equal parts")
    # The vocabulary needs no divisibility: it is padded to a multiple of tp (padding never
    # enters the loss). MoE experts are split along their hidden width like the dense MLP, so
    # n_expert needs no divisibility by tp either.
    return config
