"""Read any region of a global tensor out of a checkpoint, whatever layout wrote it.

A reader asks for a box of the global tensor (and, for a ZeRO-1 optimizer piece, a flat range of that
box); the planner intersects it with the slices the manifest lists and reads only the bytes of those
intersections (safetensors `get_slice`), never whole files or the whole model. Same-layout loads are the
special case where every intersection is a whole stored slice (then its checksum is checked too).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from .layout import CheckpointError
from .manifest import crc32_bytes


def overlap(a, b) -> Optional[list]:
    """Intersection of two boxes ([[start, end] per dim]) or None."""
    out = [[max(x0, y0), min(x1, y1)] for (x0, x1), (y0, y1) in zip(a, b)]
    return out if all(lo < hi for lo, hi in out) else None


def _shape(box) -> list:
    return [hi - lo for lo, hi in box]


def _rel(inner, outer) -> tuple:
    """`inner` as slices relative to the corner of `outer`."""
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(inner, outer))


class SliceReader:
    """Reads slices from one step folder, with one open handle per file and manifest checks on open."""

    def __init__(self, step_dir: Path, manifest: dict):
        self.dir, self.man = Path(step_dir), manifest
        self.handles: dict = {}
        self.bytes_read = 0

    def _open(self, rel: str):
        if rel not in self.handles:
            path = self.dir / rel
            meta = self.man["files"].get(rel)
            if meta is None:
                raise CheckpointError(f"{self.dir.name}: {rel} is not listed in the manifest's files")
            if not path.is_file():
                raise CheckpointError(f"{self.dir.name}: shard {rel} is missing "
                                      f"(layout {_layout(self.man)} expects it)")
            size = path.stat().st_size
            if size != meta["bytes"]:
                raise CheckpointError(f"{self.dir.name}: {rel} is {size} bytes, the manifest says "
                                      f"{meta['bytes']} (truncated or replaced?)")
            try:
                self.handles[rel] = safe_open(str(path), framework="pt")
            except Exception as e:  # noqa: BLE001 - a damaged header
                raise CheckpointError(f"{self.dir.name}: {rel} is not a readable safetensors file ({e})") from None
        return self.handles[rel]

    def _stored(self, name: str, sl: dict):
        f = self._open(sl["file"])
        if sl["key"] not in f.keys():
            raise CheckpointError(f"{self.dir.name}: tensor '{name}' (key '{sl['key']}') is missing from {sl['file']}")
        view = f.get_slice(sl["key"])
        want = [sl["flat"][1] - sl["flat"][0]] if "flat" in sl else _shape(sl["box"])
        if list(view.get_shape()) != want:
            raise CheckpointError(f"{self.dir.name}: tensor '{name}' in {sl['file']} has shape "
                                  f"{list(view.get_shape())}, the manifest says {want}")
        return view

    def _read(self, name: str, sl: dict, index: tuple) -> torch.Tensor:
        view = self._stored(name, sl)
        whole = all(s.start == 0 and s.stop == n for s, n in zip(index, view.get_shape()))
        t = view[index] if not whole else self.handles[sl["file"]].get_tensor(sl["key"])
        self.bytes_read += t.numel() * t.element_size()
        if whole and "crc32" in sl and f"{crc32_bytes(t.contiguous().numpy()):08x}" != sl["crc32"]:
            raise CheckpointError(f"{self.dir.name}: tensor '{name}' in {sl['file']} fails its checksum "
                                  f"(the file is corrupted)")
        return t

    def read(self, name: str, entry: dict, box, flat: Optional[tuple] = None) -> torch.Tensor:
        """The region `box` of tensor `name` (shape of the box), or elements flat[0]:flat[1] of it (1-D)."""
        box = [list(r) for r in box]
        if flat is not None:
            fast = self._read_flat_same_box(name, entry, box, flat)
            if fast is not None:
                return fast
        out = torch.empty(_shape(box), dtype=torch.float32)
        filled = 0
        by_box: dict = {}
        for sl in entry["slices"]:
            by_box.setdefault(tuple(map(tuple, sl["box"])), []).append(sl)
        for sbox, slices in by_box.items():
            sbox = [list(r) for r in sbox]
            inter = overlap(sbox, box)
            if inter is None:
                continue
            if "flat" not in slices[0]:
                out[_rel(inter, box)] = self._read(name, slices[0], _rel(inter, sbox))
            else:  # ZeRO-1 pieces: rebuild that one box (one tp slice of one tensor), then cut
                whole = torch.empty(math.prod(_shape(sbox)), dtype=torch.float32)
                for sl in slices:
                    a, b = sl["flat"]
                    whole[a:b] = self._read(name, sl, (slice(0, b - a),))
                out[_rel(inter, box)] = whole.view(_shape(sbox))[_rel(inter, sbox)]
            filled += math.prod(_shape(inter))
        if filled != math.prod(_shape(box)):
            raise CheckpointError(f"{self.dir.name}: tensor '{name}': the stored slices cover {filled} of the "
                                  f"{math.prod(_shape(box))} elements requested")
        return out if flat is None else out.view(-1)[flat[0]:flat[1]].clone()

    def _read_flat_same_box(self, name, entry, box, flat) -> Optional[torch.Tensor]:
        """A ZeRO-1 piece from pieces of the same box (same tp size): read only the overlapping ranges."""
        pieces = [sl for sl in entry["slices"] if sl["box"] == box and "flat" in sl]
        if not pieces:
            return None
        a, b = flat
        out = torch.empty(b - a, dtype=torch.float32)
        filled = 0
        for sl in pieces:
            pa, pb = sl["flat"]
            lo, hi = max(a, pa), min(b, pb)
            if lo < hi:
                out[lo - a:hi - a] = self._read(name, sl, (slice(lo - pa, hi - pa),))
                filled += hi - lo
        return out if filled == b - a else None


def _layout(man: dict) -> str:
    lay = man.get("layout", {})
    return f"tp={lay.get('tp')} pp={lay.get('pp')} dp={lay.get('dp')}"
