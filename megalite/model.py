"""GPT-2, written in *local* heads and width, built from the tensor-parallel layers.

One `GPTStage` is the part of the model a pipeline stage holds: the embeddings on the first stage,
a contiguous range of blocks (keyed by their global layer id), and the final LayerNorm + LM head on the
last (tied to wte, as in GPT-2, or a separate `lm_head.weight`). With tp = pp = 1 it is the whole GPT-2;
the options Hugging Face's GPT2Config has and megalite honours are `tie_embeddings`, `layer_norm_eps`
and `activation` (see README, "Hugging Face fidelity"). With vpp virtual stages a stage holds vpp chunks of
blocks (`forward(..., chunk=j)` runs one); the embeddings belong to chunk 0 of the first stage, the head to
the last chunk of the last stage.

Memory features (issue 13): with sequence parallelism (sp) the residual stream between the tp regions is
(B, T/tp, C) on each rank (LayerNorm, dropout and the residual adds run on seq/tp of the tokens);
recompute = "selective" recomputes the attention core in backward, "full" each block from its input.

Context parallelism (cp, issue 22; parallel/context.py): each rank holds 2 of a sequence's 2cp chunks, (B, T/cp)
tokens at their global positions; attention is ring attention over the cp group, everything else is per token.
With dropout on, attention uses the counter-based mask of context.py at every layout, cp = 1 included, so every
layout drops the same attention weights as the single process.
"""
from __future__ import annotations

import math
from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import functools

from einops import rearrange
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig
from .parallel.context import draw_seed, local_positions, ring_attention
from .parallel.grid import Axis, ParallelGrid
from .parallel.pipeline import chunk_layers
from .parallel.partition import Partition, init_local, local_shape, partition_of, tag
from .parallel.tensor import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, copy_to_tp,
                              gather_from_sp, seq_chunk, vocab_parallel_cross_entropy)


ACTIVATION_FNS = {"gelu_new": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "relu": F.relu}


def _replicated(shape: tuple, placement: str, init: str, decay: bool = True) -> nn.Parameter:
    return tag(nn.Parameter(torch.zeros(shape)), Partition(shape, None, placement=placement, init=init, decay=decay))


class LayerNorm(nn.Module):
    """Replicated on every tp rank: its input (the residual stream) is the same everywhere."""

    def __init__(self, dim: int, eps: float, placement: str):
        super().__init__()
        self.eps = eps
        self.weight = _replicated((dim,), placement, "ones", decay=False)
        self.bias = _replicated((dim,), placement, "zeros", decay=False)

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class SeqDropout(nn.Module):
    """Dropout on the residual stream, the same mask whether or not it is sequence- or context-parallel.

    The mask is drawn for the whole (B, T, C) from the default generator, which all tp and cp ranks share, and
    each rank keeps the positions it holds (its sp chunk, its cp chunks): sp and cp change nothing about which
    elements drop (at the cost of drawing the whole mask, B*T*C bytes for a moment), and
    torch.utils.checkpoint's RNG replay makes recomputation draw the same mask again.
    """

    def __init__(self, p: float, tp: Axis, sp: bool, cp: Optional[Axis] = None):
        super().__init__()
        self.p, self.tp, self.sp, self.cp = p, tp, sp and tp.active, cp or Axis(1, 0)

    def forward(self, x):  # (B, T or T/tp, C); with cp (B, T/cp or T/(cp tp), C)
        if not self.training or self.p == 0.0:
            return x
        shape = list(x.shape)
        shape[1] *= (self.tp.size if self.sp else 1) * self.cp.size
        keep = torch.empty(shape, dtype=torch.bool, device=x.device).bernoulli_(1.0 - self.p)
        if self.cp.active:
            keep = keep[:, local_positions(shape[1], self.cp, self.tp, self.sp).to(x.device)]
        elif self.sp:
            keep = keep[:, slice(*seq_chunk(shape[1], self.tp))]
        return x * keep / (1.0 - self.p)


def _attention_core(q, k, v, dropout_p: float):  # (B, H, T, D) x3 -> (B, H, T, D)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: Axis, sp: bool, recompute: str, placement: str,
                 cp: Optional[Axis] = None):
        super().__init__()
        self.tp, self.cp = tp, cp or Axis(1, 0)
        self.head_dim = cfg.n_embd // cfg.n_head
        self.qkv = ColumnParallelLinear(cfg.n_embd, cfg.n_embd, tp, stack=3, sp=sp, placement=placement)  # heads / tp
        # GPT-2: residual projections start at std / sqrt(2 * n_layer)
        self.proj = RowParallelLinear(cfg.n_embd, cfg.n_embd, tp, sp=sp, placement=placement, init="scaled")
        self.dropout = cfg.dropout
        self.selective = recompute == "selective"

    def forward(self, x):  # (B, T, C) -> (B, T, C); with sp (B, T/tp, C) -> (B, T/tp, C)
        qkv = self.qkv(x)  # (B, T, 3 * C/tp)
        q, k, v = rearrange(qkv, "b t (three h d) -> three b h t d", three=3, d=self.head_dim)
        p = self.dropout if self.training else 0.0
        if self.cp.active or p > 0.0:  # ring attention (cp = 1: one block) with the counter-based dropout mask
            core = functools.partial(ring_attention, cp=self.cp, dropout_p=p, seed=draw_seed() if p else 0,
                                     head0=self.tp.rank * q.shape[1])
        else:
            core = functools.partial(_attention_core, dropout_p=0.0)
        if self.selective and torch.is_grad_enabled():
            # Selective recomputation (Korthikanti et al.): keep only q, k, v; the softmax statistics and the
            # output are recomputed in backward (the dropout mask comes from the seed drawn above).
            y = checkpoint(core, q, k, v, use_reentrant=False)
        else:
            y = core(q, k, v)
        return self.proj(rearrange(y, "b h t d -> b t (h d)"))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: Axis, sp: bool, placement: str):
        super().__init__()
        self.fc = ColumnParallelLinear(cfg.n_embd, 4 * cfg.n_embd, tp, sp=sp, placement=placement)
        self.proj = RowParallelLinear(4 * cfg.n_embd, cfg.n_embd, tp, sp=sp, placement=placement, init="scaled")
        self.act = ACTIVATION_FNS[cfg.activation]

    def forward(self, x):  # (B, T, C) -> (B, T, C)
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """Transformer block `layer` (its global id): every parameter's tag says it is placed with that layer."""

    def __init__(self, cfg: ModelConfig, tp: Axis, layer: int, sp: bool = False, recompute: str = "none",
                 cp: Optional[Axis] = None):
        super().__init__()
        place = f"layer.{layer}"
        self.ln_1 = LayerNorm(cfg.n_embd, cfg.layer_norm_eps, place)
        self.attn = CausalSelfAttention(cfg, tp, sp, recompute, place, cp)
        self.ln_2, self.mlp = LayerNorm(cfg.n_embd, cfg.layer_norm_eps, place), MLP(cfg, tp, sp, place)
        self.drop = SeqDropout(cfg.dropout, tp, sp, cp)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class GPTStage(nn.Module):
    def __init__(self, cfg: ModelConfig, grid: ParallelGrid, layers: Optional[range] = None, vpp: int = 1,
                 sp: bool = False, recompute: str = "none"):
        super().__init__()
        self.cfg, self.tp, self.cp = cfg, grid.tp, grid.cp
        self.sp, self.full_recompute = sp and grid.tp.active, recompute == "full"
        self.first, self.last = grid.is_first_stage, grid.is_last_stage
        self.chunks = [layers] if layers is not None else chunk_layers(cfg.n_layer, grid.layout.pp, vpp)[grid.coord.pp]
        self.layers = [i for chunk in self.chunks for i in chunk]
        if self.first:  # `tied`: the last stage holds a copy (the LM head) whose gradient is summed with it
            self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.n_embd, grid.tp, sp=self.sp, placement="first",
                                              tied=cfg.tie_embeddings and not self.last)
            self.wpe = _replicated((cfg.block_size, cfg.n_embd), "first", "normal")
            self.drop = SeqDropout(cfg.dropout, grid.tp, self.sp, grid.cp)
        self.blocks = nn.ModuleDict({str(i): Block(cfg, grid.tp, i, self.sp, recompute, grid.cp)
                                     for i in self.layers})
        if self.last:
            self.ln_f = LayerNorm(cfg.n_embd, cfg.layer_norm_eps, "last")
            if not cfg.tie_embeddings:  # a separate LM head, vocab-split like wte: global name lm_head.weight
                head = Partition((cfg.vocab_size, cfg.n_embd), dim=0, placement="last", init="normal")
                self.lm_head = nn.ParameterDict({"weight": tag(nn.Parameter(torch.zeros(local_shape(
                    head, grid.tp.size))), head)})
            elif not self.first:  # the tied LM head lives on another stage: keep a synchronised copy
                # same name, seed and init as wte.weight: starts identical; `tied`: gradients summed with it
                wte = Partition((cfg.vocab_size, cfg.n_embd), dim=0, tied_to="wte.weight", placement="last",
                                init="normal", tied=True)
                self.lm_head = tag(nn.Parameter(torch.zeros(local_shape(wte, grid.tp.size))), wte)

    # -- parameters by global name (what checkpoints, the optimizer and the converter use)
    def global_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(global name, parameter); the LM-head copy is reported under the name it is tied to."""
        for name, p in self.named_parameters():
            yield (partition_of(p).tied_to or name), p

    def init_weights(self, seed: int) -> None:
        std = 0.02
        for name, p in self.global_parameters():
            kind = partition_of(p).init
            scale = std / math.sqrt(2 * self.cfg.n_layer) if kind == "scaled" else std
            with torch.no_grad():
                p.copy_(init_local(name, partition_of(p), "normal" if kind == "scaled" else kind, seed, scale,
                                   self.tp.rank, self.tp.size))

    def run_block(self, i: int, x):
        """Block i (global id) on x; with full recomputation only x is kept, and the block is rerun (RNG
        replayed) in backward."""
        block = self.blocks[str(i)]
        if self.full_recompute and torch.is_grad_enabled():
            return checkpoint(block, x, use_reentrant=False)
        return block(x)

    def forward(self, x, targets=None, chunk: int = 0):
        """Chunk 0 of the first stage: x is ids (B, T); others: hidden (B, T, C) ((B, T/tp, C) with sp).
        With cp, T is this rank's T/cp tokens (its two chunks, context.split_sequence) at their global positions.
        The last chunk of the last stage returns the mean loss over its tokens (or local logits (B, T, V/tp) when
        targets is None); others return hidden."""
        if self.first and chunk == 0:
            T = x.shape[1]
            if self.cp.active:  # the wpe rows of the global positions this rank holds
                pos = self.wpe[local_positions(T * self.cp.size, self.cp, self.tp, self.sp).to(x.device)]
            else:
                pos = self.wpe[slice(*seq_chunk(T, self.tp))] if self.sp else self.wpe[:T]
            x = self.drop(self.wte(x) + pos)  # (B, T, C); with sp (B, T/tp, C)
        for i in self.chunks[chunk]:
            x = self.run_block(i, x)
        if not (self.last and chunk == len(self.chunks) - 1):
            return x
        x = self.ln_f(x)
        if not self.cfg.tie_embeddings:
            head = self.lm_head.weight
        else:
            head = self.wte.weight if self.first else self.lm_head
        x = gather_from_sp(x, self.tp) if self.sp else copy_to_tp(x, self.tp)  # (B, T, C)
        logits = F.linear(x, head)  # (B, T, V/tp)
        if targets is None:
            return logits
        return vocab_parallel_cross_entropy(logits, targets, self.cfg.vocab_size, self.tp).mean()

