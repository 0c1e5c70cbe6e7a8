"""Keyed permutations: a bijection of [0, n) from a 64-bit key, applied without a table of n entries, so an
epoch's order of windows (data/mixture.py) or documents (data/documents.py) is a pure function of (seed, epoch,
...) and nothing is stored."""
from __future__ import annotations

import numpy as np

from . import _splitmix64


def key(*parts: int) -> np.ndarray:
    """A 64-bit key from small non-negative integers (a 1-element array: numpy wraps array arithmetic)."""
    k = np.zeros(1, dtype=np.uint64)
    for p in parts:
        k = _splitmix64(k ^ np.uint64(p))
    return k


def permute(p: np.ndarray, n: int, key: np.ndarray) -> np.ndarray:
    """A keyed bijection of [0, n) applied to `p` (values in [0, n)): four Feistel rounds on 2h bits
    (4**h >= n, so fewer than 4 walks on average) repeated while a value lands at n or above (cycle walking:
    still a bijection of [0, n)). Vectorised; no table of n entries."""
    half = max(1, ((max(n, 2) - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    rounds = [_splitmix64(key ^ np.uint64(r + 1)) for r in range(4)]
    x = np.asarray(p, dtype=np.uint64).copy()
    todo = np.ones(x.shape, dtype=bool)
    while todo.any():
        lo, hi = x[todo] & mask, x[todo] >> np.uint64(half)
        for rk in rounds:
            lo, hi = hi ^ (_splitmix64(lo ^ rk) & mask), lo
        x[todo] = (hi << np.uint64(half)) | lo
        todo = x >= np.uint64(n)
    return x.astype(np.int64)
