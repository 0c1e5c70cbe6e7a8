"""Tiling: the slices of one tensor must cover its global shape exactly (the check the manifest parser runs
on every tensor). Pure geometry over boxes and flat pieces; no files.
"""
from __future__ import annotations

import bisect
import math

import numpy as np

from ..parallel.partition import Box


def _pieces(entry):
    """(shape, [(Box, flat or None, file)]) from a TensorEntry, a (shape, slices) pair or a JSON entry."""
    if hasattr(entry, "slices"):
        return list(entry.shape), [(s.box, s.flat, s.file) for s in entry.slices]
    if isinstance(entry, tuple):
        shape, slices = entry
        return list(shape), [(s.box, s.flat, s.file) for s in slices]
    return list(entry["shape"]), [(tuple(tuple(r) for r in s["box"]), tuple(s["flat"]) if s.get("flat") else None,
                                   s.get("file")) for s in entry["slices"]]


DISJOINT_PAIRS = 32  # up to this many boxes, the cheap proof below is tried first (n^2 / 2 box pairs)


def _exact_cover(boxes, shape) -> bool:
    """True when boxes that lie inside `shape` cover it exactly: no two overlap and their sizes add up to the
    shape's (disjoint parts of a finite grid whose counts sum to the whole are the whole). False proves
    nothing (the grid count below then finds and names the problem). Most tensors have a few tp slices; for
    them this replaces the grid count, whose small numpy arrays were most of a manifest's parse."""
    keys = list(boxes)
    if sum(b.numel for b in keys) != math.prod(shape):
        return False
    for i, p in enumerate(keys):
        for q in keys[i + 1:]:
            if all(a < d and c < b for (a, b), (c, d) in zip(p, q)):  # they share a cell in every dim
                return False
    return True


def tiling_problems(name: str, entry) -> list[str]:
    """The slices of one tensor must cover its global shape exactly: no hole, no overlap, nothing outside.

    Up to DISJOINT_PAIRS boxes, a proof that they cover it exactly is tried first (_exact_cover); otherwise,
    or when it fails, a count linear in the number of slices (plus the grid) finds the problem: the boxes'
    start/end points cut every dim into intervals, and every cell of that grid must be covered exactly once.
    """
    shape, pieces = _pieces(entry)
    boxes: dict = {}
    for box, flat, file in pieces:
        if len(box) != len(shape) or any(not (0 <= a < b <= n) for (a, b), n in zip(box, shape)):
            return [f"tensor '{name}': slice {[list(r) for r in box]} in {file} lies outside shape {shape}"]
        boxes.setdefault(Box(box), []).append(flat)
    if not boxes:
        return [f"tensor '{name}': no slices are stored"]
    problems = []
    for box, flats in boxes.items():
        if None in flats:
            if len(flats) > 1:
                problems.append(f"tensor '{name}': box {box.to_json()} is stored more than once (overlap)")
            continue
        pos = 0
        for a, b in sorted(flats):
            if a != pos:
                problems.append(f"tensor '{name}': pieces of box {box.to_json()} "
                                f"{'overlap' if a < pos else 'leave a hole'} at element {min(a, pos)}")
                break
            pos = b
        else:
            if pos != box.numel:
                problems.append(f"tensor '{name}': pieces of box {box.to_json()} end at element {pos}, "
                                f"expected {box.numel} (a hole)")
    if problems:
        return problems
    if len(boxes) <= DISJOINT_PAIRS and _exact_cover(boxes, shape):
        return []
    cuts = [sorted({0, n} | {r[d][i] for r in boxes for i in (0, 1)}) for d, n in enumerate(shape)]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > 16 * len(boxes) + 64:  # a sane layout cuts each dim a few times; refuse a hostile grid
        return [f"tensor '{name}': its {len(boxes)} slices cut it into {cells} cells, not a grid of tp slices"]
    count = np.zeros([len(c) - 1 for c in cuts], dtype=np.int64)
    for box in boxes:
        count[tuple(slice(bisect.bisect_left(c, a), bisect.bisect_left(c, b)) for c, (a, b) in zip(cuts, box))] += 1
    if (count > 1).any():
        at = [c[i] for c, i in zip(cuts, np.argwhere(count > 1)[0])]
        problems.append(f"tensor '{name}': slices overlap at element {at}")
    if (count == 0).any():
        at = [c[i] for c, i in zip(cuts, np.argwhere(count == 0)[0])]
        problems.append(f"tensor '{name}': slices leave a hole at element {at}")
    return problems
