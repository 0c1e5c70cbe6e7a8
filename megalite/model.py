"""GPT-2 and Llama, written in *local* heads and width, built from the tensor-parallel layers.

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

Families (megalite/models/, one spec file each): the model never compares a family's name; each layer asks the
family's features (`cfg.spec.features`, models/spec.py) where it differs:
    norm       LayerNorm (weight, bias)        | RMSNorm (weight)
    positions  a learned table wpe             | rotary on q and k at each token's global position (rotate-half;
                                                 rope_scaling llama3 or yarn)
    MLP        fc -> activation -> proj        | proj(silu(gate x) * up x)            (dense biases: GPT-2's)
    attention  fused qkv (3, C, C)             | q, k, v apart (kv_heads <= n_head: GQA; q/k/v biases: Qwen2;
                                                 per-head q/k RMSNorm before rotary: Qwen3; a head width of its
                                                 own: head_size; a sliding window: Mistral)
Names: docs/families.md.
"""
from __future__ import annotations

import math
from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import functools

from torch.utils.checkpoint import checkpoint

from .attention import block_mask, flex_core, uses_flex
from .config import ModelConfig
from .parallel.context import draw_seed, local_positions, ring_attention, split_sequence
from .parallel.grid import Axis, ParallelGrid
from .parallel.pipeline import chunk_layers
from .parallel.partition import Partition, init_local, local_shape, partition_of, tag
from .parallel.tensor import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, column_parallel,
                              copy_to_tp, gather_from_sp, seq_chunk, vocab_parallel_cross_entropy)


ACTIVATION_FNS = {"gelu_new": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "relu": F.relu}


def _replicated(shape: tuple, placement: str, init: str, decay: bool = True, tp_partial: bool = False) -> nn.Parameter:
    return tag(nn.Parameter(torch.zeros(shape)), Partition(shape, None, placement=placement, init=init, decay=decay,
                                                           tp_partial=tp_partial))


class LayerNorm(nn.Module):
    """Replicated on every tp rank: its input (the residual stream) is the same everywhere."""

    def __init__(self, dim: int, eps: float, placement: str):
        super().__init__()
        self.eps = eps
        self.weight = _replicated((dim,), placement, "ones", decay=False)
        self.bias = _replicated((dim,), placement, "zeros", decay=False)

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """Llama's norm: x / rms(x) * weight (no mean, no bias); replicated on every tp rank like LayerNorm."""

    def __init__(self, dim: int, eps: float, placement: str, tp_partial: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = _replicated((dim,), placement, "ones", decay=False, tp_partial=tp_partial)

    def forward(self, x):
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def norm(cfg: ModelConfig, placement: str) -> nn.Module:
    return (RMSNorm if cfg.spec.features.norm == "rms" else LayerNorm)(cfg.n_embd, cfg.layer_norm_eps, placement)


def head_norm(cfg: ModelConfig, placement: str) -> nn.Module:
    """Qwen3's RMSNorm over each head's width, one weight shared by every head: replicated on every tp rank, which
    applies it to its own heads only, so its gradient is summed over tp (the tag's tp_partial, finalize.py)."""
    return RMSNorm(cfg.head_dim, cfg.layer_norm_eps, placement, tp_partial=True)


# ---------------------------------------------------------------- rotary position embeddings (Llama)
def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """The D/2 angular frequencies theta^(-2i/D) (`rope_attention_factor`: what cos and sin are scaled by).

    rope_scaling "llama3" (Llama 3.1/3.2), as transformers: wavelengths longer than original_max_position_embeddings
    / low_freq_factor are slowed by `factor`, shorter than .../high_freq_factor kept, the band between blended
    linearly in original_max / wavelength. "yarn" (Peng et al. 2023, transformers' definition): dims that turn
    fewer than beta_slow times over the original context are interpolated (slowed by `factor`), more than
    beta_fast times extrapolated (kept), a linear ramp between; attention_factor (default 0.1 ln(factor) + 1, or
    the mscale ratio) scales cos and sin."""
    d = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)  # (D/2,)
    rs = cfg.rope_scaling
    if not rs:
        return inv
    if rs.get("rope_type", rs.get("type")) == "yarn":
        return _yarn(inv, d, cfg.rope_theta, rs)[0]
    old, lo, hi = rs["original_max_position_embeddings"], rs["low_freq_factor"], rs["high_freq_factor"]
    ratio = old / (2 * math.pi / inv)  # context length in wavelengths
    blend = ((ratio - lo) / (hi - lo)).clamp(0.0, 1.0)  # 0: slowed whole (long waves), 1: kept (short ones)
    return inv / rs["factor"] * (1 - blend) + inv * blend


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are scaled by: yarn's attention factor, else 1."""
    rs = cfg.rope_scaling
    if rs and rs.get("rope_type", rs.get("type")) == "yarn":
        return _yarn(torch.ones(cfg.head_dim // 2), cfg.head_dim, cfg.rope_theta, rs)[1]
    return 1.0


def _yarn(inv: torch.Tensor, d: int, theta: float, rs: dict) -> tuple[torch.Tensor, float]:
    factor, old = rs["factor"], rs["original_max_position_embeddings"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = rs.get("attention_factor")
    if attn is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def dim_of(rotations):  # the dim whose wavelength turns `rotations` times over the original context
        return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_of(rs.get("beta_fast") or 32), dim_of(rs.get("beta_slow") or 1)
    if rs.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - lo) / ((hi - lo) or 0.001)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolated (kept), 0: interpolated (slowed by factor)
    return inv / factor * (1 - keep) + inv * keep, float(attn)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype, scale: float = 1.0) -> tuple:
    """cos and sin (T, D) of the angles position * frequency (`rope_frequencies`), each frequency twice
    (rotate-half layout), times `scale` (yarn's attention factor)."""
    angles = positions.float()[:, None] * inv_freq[None]  # (T, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, D)
    if scale != 1.0:
        return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x, cos, sin):  # (B, H, T, D) with (T, D): dims i and i + D/2 of each head turn as one pair
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


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


def document_positions(docs: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids (runs along each row, data/documents.py) -> each token's position in its document."""
    i = torch.arange(docs.shape[1], device=docs.device).expand_as(docs)
    new = torch.ones_like(docs, dtype=torch.bool)
    new[:, 1:] = docs[:, 1:] != docs[:, :-1]
    return i - torch.where(new, i, 0).cummax(dim=1).values


def _attention_core(q, k, v, dropout_p: float, window: int = 0, docs=None):  # (B, H, T, D), (B, H/g, S, D) x2
    """Causal attention of T queries over S >= T keys, the queries being the last T of the S positions (S > T:
    keys held in a KV cache); with `window`, query i sees keys i - window < j <= i (transformers'
    sliding_window_overlay); with `docs` (B, T) (data.document_mask, S = T), only the keys of its own document
    (block-causal, a (B, 1, T, T) mask). One query over all keys needs no mask. -> (B, H, T, D)"""
    T, S = q.shape[2], k.shape[2]
    mask = None
    if (window and window < S) or 1 < T < S or docs is not None:
        i = torch.arange(S - T, S, device=q.device)[:, None]  # the queries' positions
        j = torch.arange(S, device=q.device)[None, :]
        mask = (j <= i) & (i - j < window) if window else j <= i  # (T, S)
    if docs is not None:
        mask = mask & (docs[:, None, :, None] == docs[:, None, None, :])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                          dropout_p=dropout_p, enable_gqa=k.shape[1] != q.shape[1])


def _ring_core(q, k, v, groups: int, **kw):
    """Ring attention with each kv head repeated for its `groups` query heads (transformers' repeat_kv order:
    query head i uses kv head i // groups); the ring carries the repeated (k, v)."""
    if groups > 1:
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    return ring_attention(q, k, v, **kw)


class CausalSelfAttention(nn.Module):
    """Fused (GPT-2): one stacked qkv weight (3, C, C). Apart (the rotary families): q (n_head * D, C), k and v
    (kv_heads * D, C), biases where the family has them (Qwen2); the kv heads are split across tp when tp divides
    them, else each is held by the tp / kv_heads ranks whose query heads use it (ColumnParallelLinear's `units`);
    a per-head RMSNorm on q and k where the family has one (Qwen3), then rotary on q and k; a sliding window
    where the family has one (Mistral)."""

    def __init__(self, cfg: ModelConfig, tp: Axis, sp: bool, recompute: str, placement: str,
                 cp: Optional[Axis] = None):
        super().__init__()
        self.cfg, self.tp, self.cp, self.sp = cfg, tp, cp or Axis(1, 0), sp
        f = self.features = cfg.spec.features
        self.head_dim = D = cfg.head_dim
        width = cfg.n_head * D
        if f.fused_qkv:
            self.qkv = ColumnParallelLinear(cfg.n_embd, width, tp, stack=3, bias=f.qkv_bias, sp=sp,
                                            placement=placement)
            self.groups = 1
        else:
            kv = cfg.kv_heads
            self.q = ColumnParallelLinear(cfg.n_embd, width, tp, bias=f.qkv_bias, sp=sp, placement=placement)
            self.k, self.v = (ColumnParallelLinear(cfg.n_embd, kv * D, tp, bias=f.qkv_bias, sp=sp,
                                                   placement=placement, units=kv) for _ in range(2))
            self.groups = (cfg.n_head // tp.size) // max(1, kv // tp.size)  # local query heads per local kv head
        if f.qk_norm:
            self.q_norm, self.k_norm = head_norm(cfg, placement), head_norm(cfg, placement)
        if f.positions == "rope":
            # constants of the config, kept with the module so that they move to the GPU once (never saved)
            self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)
            self.rope_scale = rope_attention_factor(cfg)
        # GPT-2: residual projections start at std / sqrt(2 * n_layer); the others (transformers'): std
        self.proj = RowParallelLinear(width, cfg.n_embd, tp, bias=f.dense_bias, sp=sp, placement=placement,
                                      init="scaled" if f.init == "scaled" else "normal")
        self.window = cfg.sliding_window if f.sliding_window else 0
        self.dropout = cfg.dropout
        self.selective = recompute == "selective"

    def heads(self, x, cache=None, pos=None):
        """x (B, T, C) (sp: (B, T/tp, C)) -> q (B, H/tp, T, D), k and v (B, kv heads here, T, D); with a KV cache
        the tokens come after those it holds; `pos` (B, T): each token's position in its document
        (data.document_mask)."""
        if self.features.fused_qkv:
            qkv = self.qkv(x)  # (B, T, 3 * C/tp)
            B, T = qkv.shape[:2]  # "b t (three h d) -> three b h t d" as views (einops' Python costs a step ~1%)
            # split, not unbind: backward concatenates the three gradients (no stack and copy)
            q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in qkv.split(qkv.shape[-1] // 3, -1))
        else:
            lin = (self.q, self.k, self.v)
            qkv = column_parallel(x, [m.weight for m in lin], self.tp, self.sp)  # one input gather for all three
            if self.features.qkv_bias:
                qkv = [t + m.bias for t, m in zip(qkv, lin)]
            q, k, v = (t.reshape(*t.shape[:2], -1, self.head_dim).transpose(1, 2) for t in qkv)  # (B, H, T, D)
        if self.features.qk_norm:  # over each head's width, before rotary (transformers' Qwen3)
            q, k = self.q_norm(q), self.k_norm(k)
        if self.features.positions != "rope":
            return q, k, v
        T = q.shape[2]  # this rank's tokens; with cp at their global positions (two chunks, context.py)
        if pos is not None:  # (B, T): restarting at each document
            cos, sin = (t.view(*pos.shape, -1)[:, None] for t in
                        rope_cos_sin(self.inv_freq, pos.reshape(-1), q.dtype, self.rope_scale))  # (B, 1, T, D)
            return rotate(q, cos, sin), rotate(k, cos, sin), v
        start = cache.length if cache is not None else 0
        if self.cp.active:
            pos = local_positions(T * self.cp.size, self.cp).to(q.device)
        else:
            pos = torch.arange(start, start + T, device=q.device)
        if cache is not None:  # every block turns the step's tokens by the same angles: computed once a step
            cos, sin = cache.memo(("rope", start, T, q.dtype),
                                  lambda: rope_cos_sin(self.inv_freq, pos, q.dtype, self.rope_scale))
        else:
            cos, sin = rope_cos_sin(self.inv_freq, pos, q.dtype, self.rope_scale)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def forward(self, x, cache=None, docs=None, pos=None, flex=None):  # (B, T, C) -> (B, T, C); sp: (B, T/tp, C)
        """`cache` (generate.cache.LayerCache; one process, no cp): the keys and values of the tokens before x,
        to which this call's are appended; x's tokens attend to all of them. `docs` (B, T·cp) (data.document_mask):
        the document ids of the whole rows (global order; with cp the ring reads each chunk's), `pos` (B, T):
        the position in its document of each token this rank holds. `flex` (a BlockMask, attention.block_mask):
        run the core with flex_attention under this micro-batch's mask (train.attn_backend)."""
        q, k, v = self.heads(x, cache, pos)
        if cache is not None:
            k, v = cache.append(k, v)  # (B, kv heads, S, D): every token so far
        p = self.dropout if self.training else 0.0
        if flex is not None and cache is None:  # GPTStage chose flex: no cp, no dropout (attention.uses_flex)
            core = functools.partial(flex_core, mask=flex)
        elif self.cp.active or p > 0.0:  # ring attention (cp = 1: one block) with the counter-based dropout mask
            core = functools.partial(_ring_core, groups=self.groups, cp=self.cp, dropout_p=p,
                                     seed=draw_seed() if p else 0, head0=self.tp.rank * q.shape[1],
                                     window=self.window, docs=docs)
        else:
            core = functools.partial(_attention_core, dropout_p=0.0, window=self.window, docs=docs)
        if self.selective and torch.is_grad_enabled():
            # Selective recomputation (Korthikanti et al.): keep only q, k, v; the softmax statistics and the
            # output are recomputed in backward (the dropout mask comes from the seed drawn above).
            y = checkpoint(core, q, k, v, use_reentrant=False)
        else:
            y = core(q, k, v)
        return self.proj(y.transpose(1, 2).flatten(2))  # "b h t d -> b t (h d)"


class MLP(nn.Module):
    """"act" (GPT-2): proj(act(fc x)), with the family's dense biases. "swiglu": proj(silu(gate x) * up x); gate
    and up are two column-parallel weights (their names in every checkpoint) sharing one input communication."""

    def __init__(self, cfg: ModelConfig, tp: Axis, sp: bool, placement: str):
        super().__init__()
        f = cfg.spec.features
        self.tp, self.sp, self.swiglu = tp, sp, f.mlp == "swiglu"
        hidden, bias = cfg.ffn_size, f.dense_bias
        if self.swiglu:
            self.gate, self.up = (ColumnParallelLinear(cfg.n_embd, hidden, tp, bias=False, sp=sp, placement=placement)
                                  for _ in range(2))
        else:
            self.fc = ColumnParallelLinear(cfg.n_embd, hidden, tp, bias=bias, sp=sp, placement=placement)
            self.act = ACTIVATION_FNS[cfg.activation]
        self.proj = RowParallelLinear(hidden, cfg.n_embd, tp, bias=bias, sp=sp, placement=placement,
                                      init="scaled" if f.init == "scaled" else "normal")

    def forward(self, x):  # (B, T, C) -> (B, T, C)
        if not self.swiglu:
            return self.proj(self.act(self.fc(x)))
        gate, up = column_parallel(x, [self.gate.weight, self.up.weight], self.tp, self.sp)  # (B, T, F/tp) each
        return self.proj(F.silu(gate) * up)


class Block(nn.Module):
    """Transformer block `layer` (its global id): every parameter's tag says it is placed with that layer."""

    def __init__(self, cfg: ModelConfig, tp: Axis, layer: int, sp: bool = False, recompute: str = "none",
                 cp: Optional[Axis] = None):
        super().__init__()
        place = f"layer.{layer}"
        self.ln_1 = norm(cfg, place)
        self.attn = CausalSelfAttention(cfg, tp, sp, recompute, place, cp)
        self.ln_2, self.mlp = norm(cfg, place), MLP(cfg, tp, sp, place)
        self.drop = SeqDropout(cfg.dropout, tp, sp, cp)

    def forward(self, x, cache=None, docs=None, pos=None, flex=None):
        x = x + self.drop(self.attn(self.ln_1(x), cache, docs, pos, flex))
        return x + self.drop(self.mlp(self.ln_2(x)))


class GPTStage(nn.Module):
    def __init__(self, cfg: ModelConfig, grid: ParallelGrid, layers: Optional[range] = None, vpp: int = 1,
                 sp: bool = False, recompute: str = "none", real_vocab: Optional[int] = None,
                 attn_backend: str = "auto"):
        super().__init__()
        self.attn_backend, self._flex = attn_backend, None  # train.attn_backend; (docs, (B, T), the last BlockMask)
        self.cfg, self.tp, self.cp = cfg, grid.tp, grid.cp
        # ids from real_vocab (the tokenizer's size) up to vocab_size are padding: never in the loss
        self.real_vocab = min(cfg.vocab_size, real_vocab or cfg.vocab_size)
        self.sp, self.full_recompute = sp and grid.tp.active, recompute == "full"
        self.first, self.last = grid.is_first_stage, grid.is_last_stage
        self.chunks = [layers] if layers is not None else chunk_layers(cfg.n_layer, grid.layout.pp, vpp)[grid.coord.pp]
        self.layers = [i for chunk in self.chunks for i in chunk]
        if self.first:  # `tied`: the last stage holds a copy (the LM head) whose gradient is summed with it
            self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.n_embd, grid.tp, sp=self.sp, placement="first",
                                              tied=cfg.tie_embeddings and not self.last)
            if cfg.spec.features.positions == "learned":  # rotary positions live inside attention
                self.wpe = _replicated((cfg.block_size, cfg.n_embd), "first", "normal")
            self.drop = SeqDropout(cfg.dropout, grid.tp, self.sp, grid.cp)
        self.blocks = nn.ModuleDict({str(i): Block(cfg, grid.tp, i, self.sp, recompute, grid.cp)
                                     for i in self.layers})
        if self.last:
            self.ln_f = norm(cfg, "last")
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

    def run_block(self, i: int, x, cache=None, docs=None, pos=None, flex=None):
        """Block i (global id) on x; with full recomputation only x is kept, and the block is rerun (RNG
        replayed) in backward."""
        block = self.blocks[str(i)]
        if self.full_recompute and torch.is_grad_enabled():
            return checkpoint(block, x, None, docs, pos, flex, use_reentrant=False)
        return block(x, cache, docs, pos, flex)

    def positions(self, T: int, start: int = 0, pos=None):
        """Learned: the wpe rows of the T tokens this rank holds (sp: its share; cp: their global positions;
        start: after the tokens a KV cache holds; `pos` (B, T): each token's position in its document).
        Rotary: nothing here (inside attention)."""
        if self.cfg.spec.features.positions != "learned":
            return 0.0
        if pos is not None:
            return self.wpe[pos[:, slice(*seq_chunk(T, self.tp))] if self.sp else pos]
        if self.cp.active:
            return self.wpe[local_positions(T * self.cp.size, self.cp, self.tp, self.sp).to(self.wpe.device)]
        return self.wpe[slice(*seq_chunk(T, self.tp))] if self.sp else self.wpe[start:start + T]

    def flex_mask(self, x, docs=None):
        """The BlockMask this forward's layers share when it runs flex (attention.uses_flex), else None: built
        once per micro-batch outside the blocks (a compiled block takes it as an input), and kept for the next
        chunk (vpp) of the same micro-batch (the same `docs` tensor). x: this chunk's input (ids, or hidden
        (B, T/tp, C) under sp)."""
        window = self.cfg.sliding_window if self.cfg.spec.features.sliding_window else 0
        if not uses_flex(self.attn_backend, x.device, docs is not None or window > 0,
                         self.cfg.dropout if self.training else 0.0, self.cp.size):
            return None
        B, T = x.shape[0], x.shape[1] * (self.tp.size if self.sp and x.dim() == 3 else 1)
        if self._flex is None or self._flex[0] is not docs or self._flex[1] != (B, T):
            self._flex = (docs, (B, T), block_mask(docs, window, B, T, x.device))
        return self._flex[2]

    def forward(self, x, targets=None, chunk: int = 0, cache=None, logits_to_keep: int = 0, docs=None):
        """Chunk 0 of the first stage: x is ids (B, T); others: hidden (B, T, C) ((B, T/tp, C) with sp).
        With cp, T is this rank's T/cp tokens (its two chunks, context.split_sequence) at their global positions.
        The last chunk of the last stage returns the mean loss over its tokens (or local logits (B, T, V/tp) when
        targets is None); others return hidden. `cache` (generate.cache.KVCache; tp = pp = cp = 1): x's tokens
        come after those the cache holds, and their keys and values are added to it. `logits_to_keep` n > 0
        (transformers' argument): the logits of the last n tokens only (sampling reads the last). `docs` (B, T)
        (data.document_mask): each token's document, for the whole rows (with cp: global order, not split); attention
        stays inside it and positions restart at its first token, counted along the global row and then split
        as the tokens are (context.split_sequence), so a document that crosses chunks keeps counting."""
        pos = None if docs is None else split_sequence(document_positions(docs), self.cp)
        flex = self.flex_mask(x, docs) if cache is None else None
        if self.first and chunk == 0:
            start = cache.length if cache is not None else 0
            x = self.drop(self.wte(x) + self.positions(x.shape[1], start, pos))  # (B, T, C); with sp (B, T/tp, C)
        for i in self.chunks[chunk]:
            x = self.run_block(i, x, cache.layer(i) if cache is not None else None, docs, pos, flex)
        if not (self.last and chunk == len(self.chunks) - 1):
            return x
        x = self.ln_f(x[:, -logits_to_keep:] if logits_to_keep else x)
        if not self.cfg.tie_embeddings:
            head = self.lm_head.weight
        else:
            head = self.wte.weight if self.first else self.lm_head
        x = gather_from_sp(x, self.tp) if self.sp else copy_to_tp(x, self.tp)  # (B, T, C)
        logits = F.linear(x, head)  # (B, T, V/tp)
        if targets is None:
            return logits
        return vocab_parallel_cross_entropy(logits, targets, self.cfg.vocab_size, self.tp, self.real_vocab).mean()

