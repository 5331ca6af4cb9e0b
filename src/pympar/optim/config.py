"""OptimConfig: the optimizer's section of a run's configuration (AdamW, its learning-rate
schedule, gradient clipping), with its rules in one validator."""
from __future__ import annotations

import math
from dataclasses import dataclass

MOMENTS_DTYPES = ("float32", "bfloat16")


@dataclass
class OptimConfig:
    lr: float = 1e-3                  # peak learning rate
    min_lr: float = 1e-4              # the cosine's final learning rate
    warmup: int = 20                  # linear warm-up steps
    weight_decay: float = 0.1         # AdamW's decoupled decay (matrices only: optim.decays)
    grad_clip: float = 1.0            # global gradient-norm clip; 0 = off
    moments_dtype: str = "float32"    # AdamW's m and v: float32 (the master dtype) or bfloat16

    def validate(self) -> "OptimConfig":
        """Raise ValueError naming the bad field and what would be right; return self."""
        for k in ("lr", "min_lr", "weight_decay", "grad_clip"):
            v = getattr(self, k)
            if not math.isfinite(v):
                raise ValueError(f"{k}={v} must be a finite number")
        for k in ("lr", "min_lr", "warmup", "weight_decay", "grad_clip"):
            if getattr(self, k) < 0:
                raise ValueError(f"{k}={getattr(self, k)} must be >= 0")
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr={self.min_lr} is above lr={self.lr}")
        if self.moments_dtype not in MOMENTS_DTYPES:
            raise ValueError(f"moments_dtype={self.moments_dtype!r} is not one of {list(MOMENTS_DTYPES)}")
        return self
