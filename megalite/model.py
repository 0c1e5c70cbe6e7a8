"""GPT-2, written in *local* heads and width, built from the tensor-parallel layers.

One `GPTStage` is the part of the model a pipeline stage holds: the embeddings on the first stage,
a contiguous range of blocks (keyed by their global layer id), and the final LayerNorm + tied LM head
on the last. With tp = pp = 1 it is the whole GPT-2.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from .config import ModelConfig
from .parallel.grid import Axis, ParallelGrid
from .parallel.pipeline import partition_layers
from .parallel.tensor import (ColumnParallelLinear, Partition, RowParallelLinear, VocabParallelEmbedding,
                              copy_to_tp, init_local, local_shape, partition_of, tag, vocab_parallel_cross_entropy)


def _place(module: nn.Module, placement: str) -> None:
    """Record in each parameter's tag which pipeline stage owns it."""
    for p in module.parameters():
        _retag(p, placement=placement)


def _replicated(shape: tuple, init: str) -> nn.Parameter:
    return tag(nn.Parameter(torch.zeros(shape)), Partition(shape, dim=None, init=init))


def _retag(p: nn.Parameter, **changes) -> None:
    tag(p, dataclasses.replace(partition_of(p), **changes))


class LayerNorm(nn.Module):
    """Replicated on every tp rank: its input (the residual stream) is the same everywhere."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = _replicated((dim,), "ones")
        self.bias = _replicated((dim,), "zeros")

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: Axis):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.qkv = ColumnParallelLinear(cfg.n_embd, cfg.n_embd, tp, stack=3)  # heads split across tp
        self.proj = RowParallelLinear(cfg.n_embd, cfg.n_embd, tp)
        _retag(self.proj.weight, init="scaled")  # GPT-2: residual projections get std / sqrt(2 * n_layer)
        self.dropout = cfg.dropout

    def forward(self, x):  # (B, T, C) -> (B, T, C)
        qkv = self.qkv(x)  # (B, T, 3 * C/tp)
        q, k, v = rearrange(qkv, "b t (three h d) -> three b h t d", three=3, d=self.head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(rearrange(y, "b h t d -> b t (h d)"))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: Axis):
        super().__init__()
        self.fc = ColumnParallelLinear(cfg.n_embd, 4 * cfg.n_embd, tp)
        self.proj = RowParallelLinear(4 * cfg.n_embd, cfg.n_embd, tp)
        _retag(self.proj.weight, init="scaled")

    def forward(self, x):  # (B, T, C) -> (B, T, C)
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: Axis):
        super().__init__()
        self.ln_1, self.attn = LayerNorm(cfg.n_embd), CausalSelfAttention(cfg, tp)
        self.ln_2, self.mlp = LayerNorm(cfg.n_embd), MLP(cfg, tp)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class GPTStage(nn.Module):
    def __init__(self, cfg: ModelConfig, grid: ParallelGrid, layers: Optional[range] = None):
        super().__init__()
        self.cfg, self.tp = cfg, grid.tp
        self.first, self.last = grid.is_first_stage, grid.is_last_stage
        if layers is None:
            layers = partition_layers(cfg.n_layer, grid.layout.pp)[grid.coord.pp]
        self.layers = layers
        if self.first:
            self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.n_embd, grid.tp)
            self.wpe = _replicated((cfg.block_size, cfg.n_embd), "normal")
            self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg, grid.tp) for i in layers})
        for i in layers:
            _place(self.blocks[str(i)], f"layer.{i}")
        if self.last:
            self.ln_f = LayerNorm(cfg.n_embd)
            _place(self.ln_f, "last")
            if not self.first:  # the tied LM head lives on another stage: keep a synchronised copy
                # same name, seed and init as wte.weight: starts identical; `tied`: gradients summed with it
                wte = Partition((cfg.vocab_size, cfg.n_embd), dim=0, tied_to="wte.weight", placement="last",
                                init="normal", tied=True)
                self.lm_head = tag(nn.Parameter(torch.zeros(local_shape(wte, grid.tp.size))), wte)
        if self.first and not self.last:  # the source of that copy
            _retag(self.wte.weight, tied=True)

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

    def forward(self, x, targets=None):
        """First stage: x is ids (B, T); others: hidden (B, T, C). Last stage returns the mean loss
        (or local logits (B, T, V/tp) when targets is None); others return hidden (B, T, C)."""
        if self.first:
            T = x.shape[1]
            x = self.drop(self.wte(x) + self.wpe[:T])  # (B, T, C)
        for block in self.blocks.values():
            x = block(x)
        if not self.last:
            return x
        x = self.ln_f(x)
        head = self.wte.weight if self.first else self.lm_head
        logits = F.linear(copy_to_tp(x, self.tp), head)  # (B, T, V/tp)
        if targets is None:
            return logits
        return vocab_parallel_cross_entropy(logits, targets, self.cfg.vocab_size, self.tp).mean()

