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
from .stream import read_header, read_into


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
    """Reads slices from one step folder; every file is checked against the manifest when first used.

    A read that covers a whole stored slice goes straight from the file into the destination memory (no
    memory map, no extra copy) and its CRC32 is checked; a partial read (resharding) asks safetensors for
    just that region's bytes.
    """

    def __init__(self, step_dir: Path, manifest: dict):
        self.dir, self.man = Path(step_dir), manifest
        self.headers: dict = {}  # rel -> (header, data offset)
        self.handles: dict = {}  # rel -> safe_open handle, only for partial reads

    def _header(self, rel: str):
        if rel not in self.headers:
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
                self.headers[rel] = read_header(path)
            except (ValueError, UnicodeDecodeError) as e:  # a damaged header, or not safetensors at all
                raise CheckpointError(f"{self.dir.name}: {rel} is not a readable safetensors file ({e})") from None
        return self.headers[rel]

    def _stored(self, name: str, sl: dict) -> dict:
        header, _ = self._header(sl["file"])
        entry = header.get(sl["key"])
        if entry is None:
            raise CheckpointError(f"{self.dir.name}: tensor '{name}' (key '{sl['key']}') is missing from {sl['file']}")
        want = [sl["flat"][1] - sl["flat"][0]] if "flat" in sl else _shape(sl["box"])
        if list(entry["shape"]) != want:
            raise CheckpointError(f"{self.dir.name}: tensor '{name}' in {sl['file']} has shape "
                                  f"{list(entry['shape'])}, the manifest says {want}")
        return entry

    def _read(self, name: str, sl: dict, index: tuple, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        entry = self._stored(name, sl)
        shape = entry["shape"]
        if all(s.start == 0 and s.stop == n for s, n in zip(index, shape)):  # the whole stored slice
            if out is None or out.device.type != "cpu" or not out.is_contiguous() or list(out.shape) != shape:
                out = torch.empty(shape, dtype=torch.float32)
            try:
                read_into(self.dir / sl["file"], entry, self._header(sl["file"])[1], out)
            except ValueError as e:
                raise CheckpointError(f"{self.dir.name}: tensor '{name}' in {sl['file']}: {e}") from None
            if "crc32" in sl and f"{crc32_bytes(out.numpy()):08x}" != sl["crc32"]:
                raise CheckpointError(f"{self.dir.name}: tensor '{name}' in {sl['file']} fails its checksum "
                                      f"(the file is corrupted)")
            return out
        if sl["file"] not in self.handles:
            self.handles[sl["file"]] = safe_open(str(self.dir / sl["file"]), framework="pt")
        return self.handles[sl["file"]].get_slice(sl["key"])[index]

    def read(self, name: str, entry: dict, box, flat: Optional[tuple] = None,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The region `box` of tensor `name` (shape of the box), or elements flat[0]:flat[1] of it (1-D).

        With `out` (a CPU tensor of that shape) the data lands there when it can; use the returned tensor.
        """
        box = [list(r) for r in box]
        if flat is not None:
            fast = self._read_flat_same_box(name, entry, box, flat, out)
            if fast is not None:
                return fast
        by_box: dict = {}
        for sl in entry["slices"]:
            by_box.setdefault(tuple(map(tuple, sl["box"])), []).append(sl)
        exact = by_box.get(tuple(map(tuple, box)))
        if flat is None and exact and "flat" not in exact[0]:  # same layout: one read, into place
            return self._read(name, exact[0], tuple(slice(0, n) for n in _shape(box)), out)
        full = out if (flat is None and out is not None and out.is_contiguous()) else None
        full = full if full is not None else torch.empty(_shape(box), dtype=torch.float32)
        filled = 0
        for sbox, slices in by_box.items():
            sbox = [list(r) for r in sbox]
            inter = overlap(sbox, box)
            if inter is None:
                continue
            if "flat" not in slices[0]:
                region = full[_rel(inter, box)]
                got = self._read(name, slices[0], _rel(inter, sbox), region if region.is_contiguous() else None)
                if got is not region:
                    region.copy_(got)
            else:  # ZeRO-1 pieces: rebuild that one box (one tp slice of one tensor), then cut
                whole = torch.empty(math.prod(_shape(sbox)), dtype=torch.float32)
                for sl in slices:
                    a, b = sl["flat"]
                    self._read(name, sl, (slice(0, b - a),), whole[a:b])
                full[_rel(inter, box)] = whole.view(_shape(sbox))[_rel(inter, sbox)]
            filled += math.prod(_shape(inter))
        if filled != math.prod(_shape(box)):
            raise CheckpointError(f"{self.dir.name}: tensor '{name}': the stored slices cover {filled} of the "
                                  f"{math.prod(_shape(box))} elements requested")
        return full if flat is None else full.view(-1)[flat[0]:flat[1]].clone()

    def _read_flat_same_box(self, name, entry, box, flat, out) -> Optional[torch.Tensor]:
        """A ZeRO-1 piece from pieces of the same box (same tp size): read only the overlapping ranges."""
        pieces = [sl for sl in entry["slices"] if sl["box"] == box and "flat" in sl]
        if not pieces:
            return None
        a, b = flat
        dest = out if out is not None and out.device.type == "cpu" and out.is_contiguous() else None
        dest = dest if dest is not None else torch.empty(b - a, dtype=torch.float32)
        filled = 0
        for sl in pieces:
            pa, pb = sl["flat"]
            lo, hi = max(a, pa), min(b, pb)
            if lo < hi:
                region = dest[lo - a:hi - a]
                got = self._read(name, sl, (slice(lo - pa, hi - pa),), region)
                if got is not region:
                    region.copy_(got)
                filled += hi - lo
        return dest if filled == b - a else None


def _layout(man: dict) -> str:
    lay = man.get("layout", {})
    return f"tp={lay.get('tp')} pp={lay.get('pp')} dp={lay.get('dp')}"
