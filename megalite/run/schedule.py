"""The learning-rate schedule and gradient clipping (the global gradient norm itself is parallel/finalize.py's)."""
from __future__ import annotations

import math

from ..config import TrainConfig


def lr_at(step: int, t: TrainConfig) -> float:
    """The LR of 0-based step `step` (the update that makes step + 1): linear warm-up to lr over the first
    warmup_steps updates, then cosine decay from lr (at step warmup_steps) to exactly min_lr at the last
    step (steps - 1). With steps <= warmup_steps + 1 there is no decay phase to speak of."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - 1 - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (t.lr - t.min_lr)


def clip_scale(norm: float, clip: float) -> float:
    """The factor that brings the global gradient norm down to `clip` when it is above it (1.0 otherwise, and
    with clip = 0: off); the factor is torch.nn.utils.clip_grad_norm_'s, clip / (norm + 1e-6)."""
    return clip / (norm + 1e-6) if clip > 0 and norm > clip else 1.0
