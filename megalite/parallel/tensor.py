"""Tensor parallelism in three tiers: raw collectives -> autograd functions that pair them -> layers.

Each layer tags the parameters it creates, once, with their partition (`partition.py`: global shape, split
dim, and what its caller passes: the pipeline placement, the weight's init, a tie); nothing here decides a
split from a parameter's name.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .grid import Axis
from .partition import Partition, local_shape, shard_range, tag


# ---------------------------------------------------------------- tier 1: raw collectives
def _all_reduce(x: torch.Tensor, axis: Axis, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if axis.active:
        x = x.contiguous()
        dist.all_reduce(x, op=op, group=axis.group)
    return x


def _gather_last(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    if not axis.active:
        return x
    parts = [torch.empty_like(x) for _ in range(axis.size)]
    dist.all_gather(parts, x.contiguous(), group=axis.group)
    return torch.cat(parts, dim=-1)


def _split_last(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    if not axis.active:
        return x
    return x.chunk(axis.size, dim=-1)[axis.rank].contiguous()


def _gather_seq(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """(B, T/tp, ...) on each rank -> (B, T, ...): the ranks' sequence chunks in rank order."""
    parts = [torch.empty_like(x) for _ in range(axis.size)]
    dist.all_gather(parts, x.contiguous(), group=axis.group)
    return torch.cat(parts, dim=1)


def _reduce_scatter_seq(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """(B, T, ...) partial sums on each rank -> (B, T/tp, ...): this rank's sequence chunk of the sum."""
    parts = [c.contiguous() for c in x.chunk(axis.size, dim=1)]
    out = torch.empty_like(parts[axis.rank])
    dist.reduce_scatter(out, parts, group=axis.group)
    return out


# ---------------------------------------------------------------- tier 2: autograd pairs
class _CopyToTP(torch.autograd.Function):
    """forward: identity; backward: all-reduce over tp."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g.clone(), ctx.axis), None


class _ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce over tp; backward: identity."""

    @staticmethod
    def forward(ctx, x, axis):
        return _all_reduce(x.clone(), axis)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromTP(torch.autograd.Function):
    """forward: all-gather along the last dim; backward: keep this rank's chunk."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return _gather_last(x, axis)

    @staticmethod
    def backward(ctx, g):
        return _split_last(g, ctx.axis), None


class _GatherFromSP(torch.autograd.Function):
    """Sequence parallelism, entering a tp region. forward: all-gather the sequence dim over tp;
    backward: reduce-scatter the sequence dim (each rank's input gradient is a partial sum)."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return _gather_seq(x, axis)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_seq(g, ctx.axis), None


class _ReduceScatterToSP(torch.autograd.Function):
    """Sequence parallelism, leaving a tp region. forward: reduce-scatter the partial sums along the sequence
    dim; backward: all-gather the sequence dim."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return _reduce_scatter_seq(x, axis)

    @staticmethod
    def backward(ctx, g):
        return _gather_seq(g, ctx.axis), None


class _SPColumnLinear(torch.autograd.Function):
    """Column-parallel linear(s) on a sequence-parallel input, keeping only this rank's shard for backward
    (Megatron's choice): the full input is all-gathered again in backward instead of being stored. Several
    weights (q, k, v; gate, up) share one gather each way and return one output each.

    forward: all-gather the sequence dim, then y_i = x W_i^T (+ b for a single weight); backward: all-gather
    again, grad_W_i = g_i^T x, grad_x = reduce-scatter(sum_i g_i W_i) over the sequence dim. Under autocast the
    matmuls run in the dtype autocast gave the outputs (g's), and the gradients are cast back to the fp32
    parameters and input.
    """

    @staticmethod
    def forward(ctx, x, bias, axis, *weights):
        ctx.axis, ctx.has_bias = axis, bias is not None
        ctx.save_for_backward(x, *weights)
        total = _gather_seq(x, axis)
        return tuple(F.linear(total, w, bias) for w in weights)

    @staticmethod
    def backward(ctx, *gs):
        x, *weights = ctx.saved_tensors
        total = _gather_seq(x, ctx.axis).to(gs[0].dtype)  # (B, T, in)
        grad_x = sum(g @ w.to(g.dtype) for g, w in zip(gs, weights))
        grad_x = _reduce_scatter_seq(grad_x.to(x.dtype), ctx.axis)
        grad_ws = [torch.einsum("...o,...i->oi", g, total).to(w.dtype) for g, w in zip(gs, weights)]
        grad_b = gs[0].reshape(-1, gs[0].shape[-1]).sum(0).to(weights[0].dtype) if ctx.has_bias else None
        return (grad_x, grad_b, None, *grad_ws)


# ---------------------------------------------------------------- tier 3: thin public wrappers
def copy_to_tp(x, axis: Axis):
    return _CopyToTP.apply(x, axis) if axis.active else x


def reduce_from_tp(x, axis: Axis):
    return _ReduceFromTP.apply(x, axis) if axis.active else x


def gather_from_tp(x, axis: Axis):
    return _GatherFromTP.apply(x, axis) if axis.active else x


def gather_from_sp(x, axis: Axis):
    return _GatherFromSP.apply(x, axis) if axis.active else x


def reduce_scatter_to_sp(x, axis: Axis):
    return _ReduceScatterToSP.apply(x, axis) if axis.active else x


def seq_chunk(n: int, axis: Axis) -> tuple[int, int]:
    """[start, end) of the sequence positions this tp rank holds under sequence parallelism."""
    per = n // axis.size
    return axis.rank * per, (axis.rank + 1) * per


# ---------------------------------------------------------------- layers
class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split across tp: each rank computes its slice of the outputs.

    `stack` > 1 fuses several same-shaped projections (q, k, v) into one weight of global shape
    (stack, out, in), split on the `out` dim: the stored tensor means the same thing at every tp size.
    forward: copy_to_tp on the input (its backward all-reduces the input gradient); output stays split
    unless gather_output (only meaningful for stack == 1: a gathered stacked output is ordered per rank).
    With sp the input is this rank's sequence chunk (B, T/tp, in), all-gathered inside _SPColumnLinear.
    `placement` and `init` (the weight's; the bias starts at zero) go into the parameters' tags. `units`: the
    outputs are that many blocks tp never cuts (GQA's kv heads, partition.Partition.units); with tp > units a
    rank computes the block its tp/units group shares.
    """

    def __init__(self, in_features: int, out_features: int, tp: Axis, bias: bool = True, stack: int = 1,
                 gather_output: bool = False, sp: bool = False, placement: str = "first", init: str = "normal",
                 units: int = 0):
        super().__init__()
        self.tp, self.gather_output, self.sp = tp, gather_output, sp
        lead = (stack,) if stack > 1 else ()
        split = len(lead)
        self.weight = _param(Partition(lead + (out_features, in_features), split, placement=placement, init=init,
                                       units=units), tp)
        self.bias = _param(Partition(lead + (out_features,), split, placement=placement, init="zeros", decay=False,
                                     units=units), tp) if bias else None
        self.in_features = in_features

    def forward(self, x):  # (..., in) -> (..., stack * out / tp)
        w, b = self.weight, self.bias
        if w.dim() > 2:  # stacked: one (stack * out / tp, in) matrix (a view; an unstacked weight needs none)
            w, b = w.reshape(-1, self.in_features), None if b is None else b.reshape(-1)
        if not self.tp.active:  # one rank: nn.Linear's own call, nothing around it
            return F.linear(x, w, b)
        (y,) = column_parallel(x, [w], self.tp, self.sp, bias=b)
        return gather_from_tp(y, self.tp) if self.gather_output else y


def column_parallel(x, weights: list, tp: Axis, sp: bool = False, bias=None) -> list:
    """[x W_i^T] for this rank's rows of column-parallel weights W_i that take the same input (q, k, v of
    attention; gate and up of SwiGLU): one input communication each way for all of them, and no weight copied.
    forward: copy_to_tp (sp: all-gather the sequence); backward: all-reduce (sp: reduce-scatter) of grad x.
    `bias` only with a single weight (ColumnParallelLinear)."""
    if sp and tp.active:  # x: (B, T/tp, in)
        return list(_SPColumnLinear.apply(x, bias, tp, *weights))
    x = copy_to_tp(x, tp)
    return [F.linear(x, w, bias) for w in weights]


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split across tp: each rank holds a partial sum.

    forward: local matmul, then reduce_from_tp (all-reduce) of the partial sums, then the replicated bias;
    backward: the output gradient is used as is (identity), the input gradient stays split.
    With sp the partial sums are reduce-scattered along the sequence instead (B, T/tp, out).
    `placement` and `init` (the weight's; the bias starts at zero) go into the parameters' tags.
    """

    def __init__(self, in_features: int, out_features: int, tp: Axis, bias: bool = True, sp: bool = False,
                 placement: str = "first", init: str = "normal"):
        super().__init__()
        self.tp, self.sp = tp, sp
        self.weight = _param(Partition((out_features, in_features), 1, placement=placement, init=init), tp)
        self.bias = _param(Partition((out_features,), None, placement=placement, init="zeros", decay=False),
                           tp) if bias else None

    def forward(self, x):  # (..., in / tp) -> (..., out)
        if not self.tp.active:  # nothing to reduce: the bias inside the matmul, as nn.Linear adds it
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x, self.weight)
        y = reduce_scatter_to_sp(y, self.tp) if self.sp else reduce_from_tp(y, self.tp)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocab rows are split across tp (ceil chunks; padding rows on the last rank).

    forward: ids outside this rank's range are masked to zero vectors, then reduce_from_tp sums the
    partial lookups; backward: identity, so each rank's rows receive only their own ids' gradients.
    With sp the partial lookups are reduce-scattered along the sequence instead: (B, T/tp, C).
    `tied`: another stage holds a copy of this weight (a tied LM head), so their gradients are summed.
    """

    def __init__(self, num_embeddings: int, dim: int, tp: Axis, sp: bool = False, placement: str = "first",
                 tied: bool = False):
        super().__init__()
        self.tp, self.sp = tp, sp
        self.weight = _param(Partition((num_embeddings, dim), 0, placement=placement, init="normal", tied=tied), tp)
        self.start, self.end = shard_range(num_embeddings, tp.rank, tp.size)

    def forward(self, ids):  # (B, T) -> (B, T, C)
        if not self.tp.active:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_to_sp(out, self.tp) if self.sp else reduce_from_tp(out, self.tp)


def _param(p: Partition, tp: Axis) -> nn.Parameter:
    """A zero parameter of this rank's local shape, tagged (p.init names how init_weights fills it)."""
    return tag(nn.Parameter(torch.zeros(local_shape(p, tp.size))), p)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over vocab-split logits; no rank ever holds a full-vocab row.

    forward: all-reduce MAX of the row maxima, all-reduce SUM of exp-sums and of the target logit;
    backward: softmax - one_hot on the local columns (no communication).
    """

    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_valid, axis):
        # logits: (N, V_local) float32 with columns >= vocab_valid being padding
        logits = logits.clone()
        if vocab_valid < logits.shape[-1]:
            logits[:, vocab_valid:] = float("-inf")
        row_max = logits.max(dim=-1).values
        _all_reduce(row_max, axis, dist.ReduceOp.MAX)
        logits.sub_(row_max.unsqueeze(-1))
        local_t = target - vocab_start
        inside = (local_t >= 0) & (local_t < vocab_valid)
        local_t = local_t.masked_fill(~inside, 0)
        t_logit = logits.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        _all_reduce(t_logit, axis)
        exp = logits.exp_()
        sum_exp = exp.sum(dim=-1)
        _all_reduce(sum_exp, axis)
        loss = sum_exp.log() - t_logit
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, local_t, inside)
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, local_t, inside = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= inside.to(grad.dtype)
        return grad * g.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_size: int, tp: Axis,
                                 real_vocab: int | None = None):
    """Per-token loss from logits (..., V_local) split over tp; vocab padding is never counted: neither tp's
    ceil-chunk padding nor the rows from `real_vocab` (the tokenizer's size) up to vocab_size."""
    start, end = shard_range(vocab_size, tp.rank, tp.size)
    end = min(end, vocab_size if real_vocab is None else real_vocab)
    shape = target.shape
    if not tp.active:  # one rank holds every column: torch's fused kernel (fewer passes over the logits)
        valid = logits[..., :end] if end < logits.shape[-1] else logits
        return F.cross_entropy(valid.float().reshape(-1, end), target.reshape(-1), reduction="none").reshape(shape)
    loss = _VocabParallelCrossEntropy.apply(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1),
                                            start, max(0, end - start), tp)
    return loss.reshape(shape)
