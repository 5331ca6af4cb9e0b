"""Learning-rate schedule: linear warmup, then cosine decay to min_lr."""
from __future__ import annotations

import math


def cosine_lr(step, max_lr, warmup, total, min_lr=0.0) -> float:
    """lr at step (0-based): (step+1)/warmup * max_lr during warmup, cosine to min_lr at total,
    min_lr afterwards."""
    if step < warmup:
        return max_lr * (step + 1) / warmup
    if step >= total:
        return min_lr
    frac = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * frac)) * (max_lr - min_lr)
