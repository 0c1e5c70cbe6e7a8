"""train.attn_backend: which kernel runs a masked attention core (document masks, sliding windows).

"sdpa" (model._attention_core): torch's scaled_dot_product_attention with a boolean (B, 1, T, T) mask built in
every layer. "flex": torch.nn.attention.flex_attention with a BlockMask built once per micro-batch (and per
pipeline chunk's forward, shared by every layer of it) from a `mask_mod` (causal, same document, inside the
window); compiled on CUDA, where its kernel skips whole blocks that share no document or lie outside the window
and never holds a T x T mask or score matrix (torchtitan's `attn_backend = "flex"`, its block_causal mask).
"auto" (the default): flex on CUDA when a mask is needed (data.document_mask, a sliding window) and flex can
run it (no attention dropout, cp = 1), sdpa otherwise. What flex cannot honour is refused in one line
(`check_backend`): attention dropout (flex has none), cp > 1 (ring attention is the cp path), training on the CPU
(torch 2.13's flex_attention has no backward there; its forward runs, unfused, for evaluation).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .base.errors import ConfigError

BACKENDS = ("auto", "sdpa", "flex")


def check_backend(backend: str, dropout: float, cp: int) -> None:
    """The config-level refusals (any device): one line naming train.attn_backend."""
    if backend not in BACKENDS:
        raise ConfigError(f"train.attn_backend = '{backend}': expected one of {', '.join(BACKENDS)}")
    if backend == "flex" and dropout > 0:
        raise ConfigError(f"train.attn_backend = 'flex' with model.dropout = {dropout}: flex_attention has no "
                          f"attention dropout; use 'sdpa' (or 'auto'), or model.dropout = 0")
    if backend == "flex" and cp > 1:
        raise ConfigError(f"train.attn_backend = 'flex' with parallel.cp = {cp}: context parallelism runs ring "
                          f"attention; use 'auto' or 'sdpa'")


def check_device(backend: str, device: torch.device) -> None:
    """Training with flex on a device whose flex_attention has no backward (the CPU in torch 2.13): one line."""
    if backend == "flex" and device.type == "cpu":
        raise ConfigError("train.attn_backend = 'flex' on the CPU: torch's flex_attention has no backward on the "
                          "CPU; use 'auto' or 'sdpa' (flex is for CUDA)")


def uses_flex(backend: str, device: torch.device, masked: bool, dropout: float, cp: int) -> bool:
    """Whether a forward runs flex: asked ("flex"), or "auto" on CUDA with a mask to honour and nothing flex
    lacks (dropout in training, cp)."""
    if backend == "flex":
        return True
    return backend == "auto" and device.type == "cuda" and masked and dropout == 0.0 and cp == 1


def mask_mod(docs: Optional[torch.Tensor], window: int):
    """flex_attention's mask_mod: query q sees key k when k <= q (causal), k > q - window (the window, when
    set) and both are in one document (docs (B, T), when given): the same rule as model._attention_core."""
    def allowed(b, h, q, k):
        ok = k <= q
        if window:
            ok = ok & (q - k < window)
        if docs is not None:
            ok = ok & (docs[b, q] == docs[b, k])
        return ok
    return allowed


def block_mask(docs: Optional[torch.Tensor], window: int, B: int, T: int, device: torch.device):
    """One micro-batch's BlockMask (`mask_mod`'s rule, in 128 x 128 blocks), built once and handed to every layer
    (model.GPTStage.flex_mask). On CUDA create_block_mask is compiled (as torchtitan does), so the rule is
    evaluated block by block and no T x T tensor is made; eager (the CPU) evaluates it densely, once."""
    return _builder(device.type)(mask_mod(docs, window), B if docs is not None else None, None, T, T, device=device)


@functools.cache
def _builder(device_type: str):
    from torch.nn.attention.flex_attention import create_block_mask
    return torch.compile(create_block_mask) if device_type == "cuda" else create_block_mask


@functools.cache
def _kernel(device_type: str):
    """flex_attention, compiled on CUDA (its fused kernel; eager flex computes every score); eager elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False) if device_type == "cuda" else flex_attention


def flex_core(q, k, v, mask):  # (B, H, T, D), (B, H/g, T, D) x2 -> (B, H, T, D)
    """Attention of each query over the keys the BlockMask `mask` allows; kv heads shared by H/g query heads."""
    return _kernel(q.device.type)(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
