"""`megalite bench blend`: the mixture's blend (data/mixture.py: blend) beside megatron-core's C++ helper.

For each corpus size (tokens) the blend of the samples that many tokens make at --block-size (samples =
tokens / block size), over 3 sources at weights 0.5 / 0.3 / 0.2: megalite's pure-Python rule against
megatron-core's `build_blending_indices` (datasets/helpers_cpp, compiled C++), when megatron-core is
installed; the two indices must be equal. A training run never builds the whole index: it extends the blend
by one global batch per step from the cursors (microseconds per step), so this row is the cost of a whole
run's index at once, the shape Megatron builds at start-up.
"""
from __future__ import annotations

import time

import numpy as np

from . import StreamTable

WEIGHTS = (0.5, 0.3, 0.2)


def _megatron():
    try:
        from megatron.core.datasets import helpers_cpp
    except ImportError:  # not installed, or its C++ helper not built here
        return None
    return helpers_cpp


def bench_blend(sizes=(10**6, 10**7, 10**8, 10**9), block_size: int = 1024, log=print) -> list:
    """One row per corpus size: samples, megalite's seconds, megatron-core's, and whether the indices agree."""
    from ..data.mixture import blend, normalise
    w = normalise(WEIGHTS)
    helpers = _megatron()
    log(f"blend of {len(w)} sources at weights {'/'.join(map(str, WEIGHTS))}, one sample = {block_size} tokens"
        + ("" if helpers else "; megatron-core's helper is not importable here: its column is empty"))
    table = StreamTable(["tokens", "samples", "megalite s", "megatron-core s", "ratio", "same index"], [14, 12])
    for tokens in sizes:
        n = max(1, tokens // block_size)
        t0 = time.perf_counter()
        src, idx, _ = blend(w, n)
        ours = time.perf_counter() - t0
        theirs = same = None
        if helpers is not None:
            ref_src, ref_idx = np.zeros(n, dtype=np.int16), np.zeros(n, dtype=np.int64)
            t0 = time.perf_counter()
            helpers.build_blending_indices(ref_src, ref_idx, w, len(w), n, False)
            theirs = time.perf_counter() - t0
            same = "yes" if np.array_equal(src, ref_src) and np.array_equal(idx, ref_idx) else "NO"
        table.row([f"{tokens:.0e}", f"{n:,}", f"{ours:.3f}", None if theirs is None else f"{theirs:.4f}",
                   None if theirs is None else f"{ours / max(theirs, 1e-9):.0f}x", same])
    return table.rows
