"""The source side of `convert --check` for other trainers' Llamas (their Source.reference()): the source run
in its own stored layout, which check.py compares with the converted result.

The reference is a plain forward (float64, one process) over the source's tensors exactly as the trainer
stores and uses them, written as that trainer computes, never through the converter's name table or weight
reshaping:
  * Megatron: the fused `linear_qkv` output viewed per query group as megatron's attention does
    ("b t (g n d) -> b t g n d": its H/G query heads, then the group's key, then its value), `linear_fc1`'s
    output split in two halves (gate, up) as megatron's SwiGLU does, rotate-half RoPE (or interleaved pairs
    where `rotary_interleaved`);
  * torchtitan: wq / wk / wv separately, RoPE on complex pairs (dims 2i, 2i+1) as Llama 3's ComplexRoPE does, or
    rotate-half as Qwen3's CosSinRoPE does; Qwen3's q_norm / k_norm over each head's width before RoPE, as its
    GQAttention.forward applies them.
So a converter that misorders the GQA groups, swaps gate and up, forgets the wq/wk permutation or keeps the
vocabulary padding gives logits that differ, and the check fails (tests/test_foreign_llama.py plants each).
Memory: the reference holds one layer's weights at a time.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F



def _inv_freq(hd: int, theta: float, scaling: dict) -> torch.Tensor:
    """RoPE's hd/2 angular frequencies; Llama 3's rescaling (Meta's reference formula) where given."""
    f = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    if scaling:
        lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
        ctx, factor = scaling["original_max_position_embeddings"], scaling["factor"]
        wavelen = 2 * math.pi / f
        smooth = (ctx / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * f / factor + smooth * f
        f = torch.where(wavelen > ctx / lo, f / factor, torch.where(wavelen < ctx / hi, f, mid))
    return f


def _rope(x: torch.Tensor, angles: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x: (B, T, heads, hd); angles: (T, hd/2)."""
    cos, sin = angles.cos()[None, :, None], angles.sin()[None, :, None]
    if interleaved:  # pairs (2i, 2i+1): the complex form
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    a, b = x.chunk(2, dim=-1)  # pairs (i, i + hd/2): rotate-half
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _attend(q, k, v, n_head: int) -> torch.Tensor:
    """q: (B, T, H, hd); k, v: (B, T, G, hd); query head i reads group i // (H/G)."""
    rep = n_head // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return y.transpose(1, 2).flatten(2)


def reference_logits(src, ids: torch.Tensor) -> torch.Tensor:
    """The source's own-layout forward: (B, T) ids -> (B, T, V) float64 logits over its real vocabulary."""
    m = src.m
    H, C, L = m["n_head"], m["n_embd"], m["n_layer"]
    hd, eps = m.get("head_size") or C // H, m["layer_norm_eps"]
    raw = src.raw  # (their tensor name, layer or None) -> float64 tensor as stored
    kind = src.native
    angles = torch.outer(torch.arange(ids.shape[1], dtype=torch.float64), _inv_freq(hd, m["rope_theta"],
                                                                                   m["rope_scaling"]))
    x = raw(kind["embed"], None)[ids]
    for i in range(L):
        h = _rms(x, raw(kind["ln_1"], i), eps)
        if kind["family"] == "megatron":
            G = m["n_kv_head"]
            qkv = h @ raw(kind["qkv"], i).T
            if kind.get("qkv_bias"):
                qkv = qkv + raw(kind["qkv_bias"], i)
            qkv = qkv.view(*h.shape[:2], G, H // G + 2, hd)  # megatron: per group, its queries, key, value
            q, k, v = qkv[..., :-2, :].flatten(2, 3), qkv[..., -2, :], qkv[..., -1, :]
        else:
            q = (h @ raw(kind["wq"], i).T).unflatten(-1, (H, hd))
            k = (h @ raw(kind["wk"], i).T).unflatten(-1, (-1, hd))
            v = (h @ raw(kind["wv"], i).T).unflatten(-1, (-1, hd))
        if "q_norm" in kind:  # over each head's width, before rotary
            q, k = _rms(q, raw(kind["q_norm"], i), eps), _rms(k, raw(kind["k_norm"], i), eps)
        q, k = _rope(q, angles, kind["interleaved"]), _rope(k, angles, kind["interleaved"])
        x = x + _attend(q, k, v, H) @ raw(kind["proj"], i).T
        h = _rms(x, raw(kind["ln_2"], i), eps)
        if kind["family"] == "megatron":
            gate, up = (h @ raw(kind["fc1"], i).T).chunk(2, dim=-1)  # megatron's SwiGLU: the first half gates
        else:
            gate, up = h @ raw(kind["w1"], i).T, h @ raw(kind["w3"], i).T
        x = x + (F.silu(gate) * up) @ raw(kind["fc2"], i).T
    head = raw(kind["head"] or kind["embed"], None)
    return (_rms(x, raw(kind["ln_f"], None), eps) @ head.T)[..., :m["vocab_size"]]
