"""Optimiser, gradient clipping, learning-rate schedule, loss scaling."""
from .adamw import AdamW, decays
from .clip import clip_grad_norm
from .config import OptimConfig
from .loss_scale import DynamicLossScaler
from .schedule import cosine_lr

__all__ = ["AdamW", "decays", "clip_grad_norm", "cosine_lr", "DynamicLossScaler", "OptimConfig"]
