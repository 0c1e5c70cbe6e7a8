"""The training run's random streams, one per rank of the grid: tp ranks share one (dropout on the replicated
residual must agree across a tp group), pp stages and dp replicas each draw their own. What a checkpoint saves
of these streams (and restores on resume) is checkpoint/state.py's; attention dropout under cp draws from a
counter-based mask instead (context.py)."""
from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int, grid) -> None:
    """Seed Python's, numpy's and torch's generators for this rank: seed + 1000 * pp + dp (tp ranks alike)."""
    s = seed + 1000 * grid.coord.pp + grid.coord.dp
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
