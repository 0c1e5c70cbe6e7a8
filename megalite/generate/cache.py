"""The KV cache of incremental decoding: the keys and values every block has computed so far, so that after the
prompt (prefill: one forward over all of it) each new token costs one forward over that token alone.

    LayerCache   one block's keys and values, (B, kv heads, T, D), in a buffer that grows by doubling
    KVCache      one LayerCache per block (by global layer id), and how many tokens they hold

model.py's attention asks its LayerCache for its start position (rotary: the new tokens' angles; GPT-2's wpe:
the rows after the cached ones), appends the new keys and values, and attends over all of them; the logits are
the full forward's at every position (tests/test_generate.py). One plain process: tp = pp = cp = 1.
"""
from __future__ import annotations

from typing import Optional

import torch


class LayerCache:
    """One block's keys and values so far. The buffer holds `capacity` positions, doubled when full (a copy per
    doubling, never one per token); `append` returns views of the filled part."""

    def __init__(self, capacity: int = 64, shared: Optional[dict] = None):
        self.capacity, self.length = max(1, capacity), 0
        self.k = self.v = None  # (B, kv heads, capacity, D)
        self.shared = {} if shared is None else shared  # KVCache's: one for all blocks

    def memo(self, key, make):
        """make(), computed once for all blocks while `key` stays the same (rotary's cos and sin of a step's
        positions: the same in every block); a new key replaces the old value."""
        if self.shared.get("key") != key:
            self.shared.update(key=key, value=make())
        return self.shared["value"]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, kv heads, T, D) of the next T tokens -> all keys and values so far, (B, kv heads, length, D)."""
        end = self.length + k.shape[2]
        if self.k is None or end > self.k.shape[2]:
            size = max(self.capacity, end) if self.k is None else max(2 * self.k.shape[2], end)
            self.k, self.v = (self._grown(old, new, size) for old, new in ((self.k, k), (self.v, v)))
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]  # (B, kv heads, length, D)

    def _grown(self, old, like: torch.Tensor, size: int) -> torch.Tensor:
        B, H, _, D = like.shape
        buf = like.new_empty(B, H, size, D)  # (B, kv heads, size, D)
        if old is not None:
            buf[:, :, :self.length] = old[:, :, :self.length]
        return buf


class KVCache:
    """Every block's LayerCache (made on first use, by global layer id); `length`: the tokens they hold, the
    position the next token takes."""

    def __init__(self, capacity: int = 64):
        self.capacity, self.layers, self.shared = capacity, {}, {}

    def layer(self, i: int) -> LayerCache:
        if i not in self.layers:
            self.layers[i] = LayerCache(self.capacity, self.shared)
        return self.layers[i]

    @property
    def length(self) -> int:
        return next(iter(self.layers.values())).length if self.layers else 0
