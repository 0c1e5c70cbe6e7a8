"""Learning-rate schedule and the global gradient norm (counted once across tp, pp and ties)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .config import TrainConfig
from .parallel.grid import ParallelGrid
from .parallel.partition import partition_of


def lr_at(step: int, t: TrainConfig) -> float:
    """The LR of 0-based step `step` (the update that makes step + 1): linear warm-up to lr over the first
    warmup_steps updates, then cosine decay from lr (at step warmup_steps) to exactly min_lr at the last
    step (steps - 1). With steps <= warmup_steps + 1 there is no decay phase to speak of."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - 1 - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (t.lr - t.min_lr)


def grad_norm(named_params, grid: ParallelGrid) -> float:
    """L2 norm of the whole model's gradient, as a single process would compute it.

    tp-replicated parameters (LayerNorms, row-parallel biases, wpe) are counted on tp rank 0 only and
    the tied LM-head copy is skipped; the partial sums are then added over the model-parallel group
    (all tp and pp ranks of one dp replica). Gradients are identical across dp after the all-reduce.
    """
    sq = torch.zeros((), dtype=torch.float64, device=named_params[0][1].device)
    for _, p in named_params:
        part = partition_of(p)
        if part.tied_to or (part.dim is None and grid.tp.rank != 0):
            continue
        sq += p.grad.detach().double().pow(2).sum()
    if grid.mp.active:
        dist.all_reduce(sq, group=grid.mp.group)
    return math.sqrt(sq.item())
