"""After the last backward, before the optimizer: make every gradient the whole model's, then measure it.

Megatron's `finalize_model_grads` is the model: one call, in one place, that does every reduction a gradient
needs after backward, so the training step does not have to know which parameters are tied, replicated or
split. In order:

    1. data and context parallelism: the mean over the dp x cp ranks that hold the same weights
       (GradBuffer.finish over `grid.dp_cp`: one all-reduce per bucket, maybe already started during backward);
    2. the sums listed by `reductions()`: each selects parameters by their partition tag and all-reduces their
       gradients over one axis, in one collective:
         - tied embedding copies (wte on the first stage, its LM-head copy on the last) over `grid.embed`;
         - with sequence parallelism, the tp-replicated parameters (LayerNorms, row-parallel biases, wpe),
           which saw seq/tp of the tokens on each rank, over `grid.tp`;
    3. the global L2 norm (every element counted once across tp, pp and ties), for clipping and the log.

Context parallelism (cp: every rank of a cp ring holds the same weights and sees 2 of each sequence's 2cp
chunks, computing the mean loss over its own T/cp tokens) adds its one reduction inside step 1, as Megatron
does: the buckets are averaged over one dp x cp group instead of dp, so a gradient is the mean over dp x cp of
per-rank means over equal token counts, i.e. the single process's mean over every token of the batch. One
collective per bucket, overlapped like dp's, rather than a second sum over `grid.cp` after it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from .data import GradBuffer
from .grid import Axis, ParallelGrid
from .partition import Partition, partition_of


@dataclass(frozen=True)
class Reduction:
    """Sum the gradients of the parameters whose tag `selects` over `axis` (nothing when it is inactive)."""
    what: str
    axis: Axis
    selects: Callable[[Partition], bool]


def reductions(grid: ParallelGrid, sp: bool) -> list[Reduction]:
    """The sums after the dp mean that make each gradient whole (see the module docstring)."""
    out = [Reduction("tied embedding copies", grid.embed, lambda part: part.tied)]
    if sp:
        out.append(Reduction("sequence-parallel replicas", grid.tp, lambda part: part.dim is None))
    return out


def finalize_grads(params: list, buffer: GradBuffer, grid: ParallelGrid, sp: bool = False) -> float:
    """Everything a gradient needs between the last backward and the optimizer; returns the global grad norm.

    `params` are (global name, parameter) in a fixed order (the same on every rank of an axis).
    Collectives: all-reduce over dp x cp (buckets), over embed and tp (one each, when active), over mp (the norm).
    """
    buffer.finish()
    for r in reductions(grid, sp):
        all_reduce_grads([p for _, p in params if r.selects(partition_of(p))], r.axis)
    return grad_norm(params, grid)


def all_reduce_grads(params: list, axis: Axis) -> None:
    """Sum these parameters' gradients over `axis` in one collective (flattened into one buffer)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not axis.active or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=axis.group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def grad_norm(named_params, grid: ParallelGrid) -> float:
    """L2 norm of the whole model's gradient, as a single process would compute it.

    tp-replicated parameters (LayerNorms, row-parallel biases, wpe) are counted on tp rank 0 only and
    the tied LM-head copy is skipped; the partial sums are then added over the model-parallel group
    (all tp and pp ranks of one dp x cp replica). Gradients are identical across dp and cp after the all-reduce.
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
