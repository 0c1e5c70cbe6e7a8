"""Read any region of a global tensor out of a checkpoint, whatever layout wrote it, checking every byte used.

A reader asks for a box of the global tensor (and, for a ZeRO-1 optimizer piece, a flat range of that
box); the planner intersects it with the slices the manifest lists and reads only the checksum blocks
those intersections touch, never whole files or the whole model. Every block read is checked against
its CRC32C before any of its bytes are used, so resharded and partial reads are as safe as whole ones.
Same-layout loads are the special case where every intersection is a whole stored slice: its bytes go
straight from the file into the destination memory and are checked there.
"""
from __future__ import annotations

import itertools
import math
import os
import weakref
from pathlib import Path
from typing import Optional

import torch

from ..base.errors import CheckpointError
from ..base.fs import open_read
from ..parallel.partition import Box
from .manifest import Manifest, SliceRef, TensorEntry
from .validate import check_file, check_key
from .stream import crc32c, raw_bytes, read_at


def lands_in(out: Optional[torch.Tensor], dtype: torch.dtype, numel: int) -> bool:
    """The one rule for reading straight into the destination: host memory, contiguous, the stored dtype
    and the right size (anything else is read into a staging buffer and copied, casting if needed)."""
    return (out is not None and out.device.type == "cpu" and out.is_contiguous() and out.dtype == dtype
            and out.numel() == numel)


def fill(target: torch.Tensor, read) -> None:
    """`read(out)` into `target`: straight into it when it is host memory and contiguous; copied otherwise."""
    direct = target.device.type == "cpu" and target.is_contiguous()
    got = read(target if direct else None)
    if got is not target:
        target.copy_(got.reshape(target.shape))


def _strides(shape) -> list:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def _runs(shape, region, itemsize: int, block: int):
    """How a region (slices into a stored tensor of `shape`, not all of it) is read, row-major.

    Returns (starts, run, outer, strides): `run` elements per contiguous run, `outer` the index ranges of the
    dims before the run's, and `starts` each run's first element when the region is a few long runs (each
    at least two checksum blocks: the q, k, v parts of a fused QKV slice), read run by run; else None: the
    region is one run, or many short ones (a column range of a matrix) read over their span."""
    st = _strides(shape)
    k = len(shape)  # dims k.. are whole: each index of dims < k-1 is one contiguous run
    while region[k - 1].start == 0 and region[k - 1].stop == shape[k - 1]:
        k -= 1
    run = (region[k - 1].stop - region[k - 1].start) * st[k - 1]
    outer = [range(s.start, s.stop) for s in region[:k - 1]]
    starts = None
    if outer and run * itemsize >= 2 * block and math.prod(map(len, outer)) <= 4096:
        first = region[k - 1].start * st[k - 1]
        starts = [sum(i * st[d] for d, i in enumerate(idx)) + first for idx in itertools.product(*outer)]
    return starts, run, outer, st


def read_ranges(inter: Box, sbox: Box, itemsize: int, block: int) -> list[tuple[int, int]]:
    """The row-major element ranges of a stored box `sbox` that reading its region `inter` touches, as
    `read_stored` reads them (`_runs`): one range per run for a few long runs, else the one span from the
    region's first element to its last (rows of a column half are not read one by one)."""
    region = inter.within(sbox)
    if all(s.start == 0 and s.stop == n for s, n in zip(region, sbox.shape)):
        return [(0, sbox.numel)]
    starts, run, _, _ = _runs(sbox.shape, region, itemsize, block)
    if starts is not None:
        return [(lo, lo + run) for lo in starts]
    return [inter.span_within(sbox)]


OPEN_FILES = 64  # files a reader keeps open at once (a load touches a few; `convert` may walk thousands)


def _close_all(files: dict) -> None:
    for f in files.values():
        f.close()
    files.clear()


class SliceReader:
    """Reads slices from one step folder; each file is checked (check_file) when first used, and every
    checksum block is verified before its bytes are used.

    Each file is opened once (when first read, after its header passed check_file) and read with positioned
    reads: a load makes one open per file, not one per slice read (78-168 per rank in `bench ckpt` at 128 MiB,
    a fixed cost that weighed most at small sizes and in a resharded load). At most OPEN_FILES stay open (the
    oldest is closed first); `close()`, a `with` block or the reader's collection closes the rest."""

    def __init__(self, step_dir: Path, manifest: Manifest):
        self.dir, self.man = Path(step_dir), manifest
        self.headers: dict = {}  # rel -> (header, data offset)
        self.files: dict = {}  # rel -> open file (insertion order: the oldest first)
        self.scratch = torch.empty(0, dtype=torch.uint8)
        self._closer = weakref.finalize(self, _close_all, self.files)

    def __enter__(self) -> "SliceReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._closer()

    def header(self, rel: str):
        if rel not in self.headers:
            self.headers[rel] = check_file(self.dir, rel, self.man)
        return self.headers[rel]

    def _file(self, rel: str):
        """`rel` open for reading: a regular file, never through a symlink (open_read), and still the size the
        manifest says (check_file checked the path; this checks what was opened)."""
        f = self.files.get(rel)
        if f is None:
            if len(self.files) >= OPEN_FILES:
                self.files.pop(next(iter(self.files))).close()
            f = open_read(self.dir / rel, buffering=0)
            size = os.fstat(f.fileno()).st_size
            if size != self.man.files[rel].bytes:
                f.close()
                raise ValueError(f"the file is {size} bytes, the manifest says {self.man.files[rel].bytes} "
                                 f"(replaced while loading?)")
            self.files[rel] = f
        return f

    def _check_blocks(self, entry: TensorEntry, sl: SliceRef, data, first_block: int) -> None:
        mv, B = memoryview(data).cast("B"), self.man.block_bytes
        for i, off in enumerate(range(0, len(mv), B)):
            k = first_block + i
            crc = f"{crc32c(mv[off:off + B]):08x}"
            if crc != sl.crc32c[k]:
                raise CheckpointError(f"{self.dir.name}: tensor '{entry.name}' in {sl.file} fails its checksum "
                                      f"(block {k}, bytes {k * B}-{k * B + len(mv[off:off + B])} of the slice: "
                                      f"crc32c {crc}, manifest {sl.crc32c[k]}); the file is corrupted")

    def read_stored(self, entry: TensorEntry, sl: SliceRef, region: Optional[tuple] = None,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`region` (slices into the stored tensor; None: all of it), its blocks checked.

        Lands in `out` when `out` is a contiguous CPU tensor of the dtype and the region's size; else the
        result may be a view of the reader's scratch buffer, valid until the next read: copy it at once."""
        shape, dtype = sl.shape, entry.torch_dtype
        want = [s.stop - s.start for s in region] if region is not None else shape
        if not lands_in(out, dtype, math.prod(want)):
            out = None

        def one_run(lo: int, n: int) -> torch.Tensor:
            got = self.read_flat(entry, sl, lo, lo + n, None if out is None else out.view(-1))
            return out if out is not None and got.data_ptr() == out.data_ptr() else got.view(want)

        if region is None or list(want) == list(shape):
            return one_run(0, sl.numel)
        starts, run, outer, st = _runs(shape, region, entry.itemsize, self.man.block_bytes)
        if starts is not None:
            # a few long runs (the q, k, v parts of a fused QKV slice): read and check only their blocks
            dest = out if out is not None else torch.empty(want, dtype=dtype)
            for lo, idx in zip(starts, itertools.product(*outer)):
                part = dest[tuple(i - s.start for i, s in zip(idx, region))].view(-1)
                got = self.read_flat(entry, sl, lo, lo + run, part)
                if got.data_ptr() != part.data_ptr():
                    part.copy_(got)
            return dest.view(want)
        lo = sum(s.start * k_ for s, k_ in zip(region, st))  # the first and last element the region touches
        if not outer:  # one contiguous run (whole rows): straight into `out` when given
            return one_run(lo, run)
        if len(outer) == 1:  # many short runs (a column range of a matrix): chunk by chunk, while cached
            dest = out if out is not None else torch.empty(want, dtype=dtype)
            self._read_runs(entry, sl, lo, st[0], run, len(outer[0]), dest.view(len(outer[0]), run))
            return dest
        hi = sum((s.stop - 1) * k_ for s, k_ in zip(region, st)) + 1
        return self.read_flat(entry, sl, lo, hi).as_strided(want, st)

    def read_flat(self, entry: TensorEntry, sl: SliceRef, lo: int, hi: int,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Elements [lo, hi) of the stored slice (row-major), reading and checking only the blocks they
        touch, each once. Lands in `out` (returned) when it is a contiguous CPU tensor of the dtype and size:
        the whole blocks inside the range are read straight into it and checked there, the partial blocks
        at either end through the scratch buffer. Without such an `out` the result is a view of the scratch
        buffer (valid until the next read)."""
        header, start = self.header(sl.file)
        h = check_key(self.dir, header, entry, sl)
        isz, B, dtype = entry.itemsize, self.man.block_bytes, entry.torch_dtype
        offset, end = start + h["data_offsets"][0], sl.numel * isz
        a, b = lo * isz, hi * isz  # the bytes wanted; blocks are [kB, min((k+1)B, end))
        ia = a if a % B == 0 else min(a // B * B + B, end)  # whole blocks inside [a, b): [ia, ib)
        ib = b if b % B == 0 or b == end else b // B * B
        into = lands_in(out, dtype, hi - lo)
        if not into or ib <= ia:  # no whole block inside: all through the scratch buffer
            blo, bhi = a // B * B, min(-(-b // B) * B, end)
            buf = self._scratch(bhi - blo).view(dtype)
            self._read(entry, sl, offset, blo, raw_bytes(buf))
            got = buf[lo - blo // isz:hi - blo // isz]
            return out.copy_(got) if into else got
        dst = raw_bytes(out)
        if a < ia:  # the head block: read whole, checked, its tail copied in
            head = raw_bytes(self._scratch(ia - a // B * B))
            self._read(entry, sl, offset, a // B * B, head)
            dst[:ia - a] = head[a % B:]
        self._read(entry, sl, offset, ia, dst[ia - a:ib - a])
        if ib < b:  # the tail block
            tail = raw_bytes(self._scratch(min(ib + B, end) - ib))
            self._read(entry, sl, offset, ib, tail)
            dst[ib - a:] = tail[:b - ib]
        return out

    def _read_runs(self, entry: TensorEntry, sl: SliceRef, first: int, stride: int, run: int, n: int,
                   dest: torch.Tensor) -> None:
        """Runs i < n of `run` elements starting at element first + i * stride of the stored slice, into the
        rows of `dest` (n, run). The blocks they span are read and checked a few at a time (each once) into
        the scratch buffer, and the runs' parts in each chunk copied out while it is in the CPU's cache."""
        header, start = self.header(sl.file)
        h = check_key(self.dir, header, entry, sl)
        isz, B, dtype = entry.itemsize, self.man.block_bytes, entry.torch_dtype
        offset, end = start + h["data_offsets"][0], sl.numel * isz
        lo, hi = first * isz // B * B, min(-(-(first + (n - 1) * stride + run) * isz // B) * B, end)
        chunk = max(4 * B, -(-run * isz // B) * B + B)  # a run spans at most two chunks
        for ca in range(lo, hi, chunk):
            cb = min(ca + chunk, hi)
            buf = self._scratch(cb - ca).view(dtype)
            self._read(entry, sl, offset, ca, raw_bytes(buf))
            e0, e1 = ca // isz, cb // isz  # elements in this chunk
            ia = max(0, (e0 - first - run) // stride + 1)  # runs [ia, ib) meet the chunk,
            ib = min(n, (e1 - 1 - first) // stride + 1)
            fa = max(ia, -(-(e0 - first) // stride))  # runs [fa, fb) lie inside it
            fb = min(ib, (e1 - run - first) // stride + 1)
            if fa < fb:
                dest[fa:fb].copy_(buf[first + fa * stride - e0:].as_strided((fb - fa, run), (stride, 1)))
            for i in [*range(ia, min(fa, ib)), *range(max(fb, ia, fa), ib)]:  # cut by the chunk's edges
                a, b = max(first + i * stride, e0), min(first + i * stride + run, e1)
                dest[i, a - first - i * stride:b - first - i * stride].copy_(buf[a - e0:b - e0])

    def _scratch(self, nbytes: int) -> torch.Tensor:
        """A reused staging buffer (fresh allocations of this size would page-fault on every read)."""
        if self.scratch.numel() < nbytes:
            self.scratch = torch.empty(max(nbytes, 2 * self.scratch.numel()), dtype=torch.uint8)
        return self.scratch[:nbytes]

    def _read(self, entry, sl, offset: int, at: int, buf) -> None:
        try:
            read_at(self._file(sl.file), offset + at, buf)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{self.dir.name}: tensor '{entry.name}' in {sl.file}: {e}") from None
        self._check_blocks(entry, sl, buf, at // self.man.block_bytes)

    def read(self, entry: TensorEntry, box, flat: Optional[tuple] = None,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The region `box` of the tensor (shape of the box), or elements flat[0]:flat[1] of it (1-D).

        With `out` (a CPU tensor of that shape) the data lands there when it can; use the returned tensor.
        The manifest's slices tile the tensor exactly (checked when it was read), so every element of the
        box comes from exactly one slice. Only what is needed is read: a piece of the same box reads the
        overlapping ranges; another box reads, from each stored slice or piece it overlaps, the span of
        that slice holding the overlap (with `flat`, of only the rows that hold elements flat[0]:flat[1])."""
        box = Box(box)
        if flat is not None and flat[0] >= flat[1]:
            return torch.empty(0, dtype=entry.torch_dtype)
        by_box: dict = {}
        for sl in entry.slices:
            by_box.setdefault(sl.box, []).append(sl)
        same = by_box.get(box)
        if same and (flat is not None or same[0].flat is not None):
            return self._read_same_box(entry, box, same, flat, out)
        if same:  # same layout: one read, into place
            ok = lands_in(out, entry.torch_dtype, box.numel)
            return self.read_stored(entry, same[0], None, out if ok else torch.empty(box.shape, dtype=entry.torch_dtype))
        need = box if flat is None else box.rows_holding(*flat)
        usable = flat is None and out is not None and out.is_contiguous() and list(out.shape) == list(box.shape)
        full = out if usable else torch.empty(need.shape, dtype=entry.torch_dtype)
        for sbox, slices in by_box.items():
            inter = sbox.intersect(need)
            if inter is None:
                continue
            region = full[inter.within(need)]
            if slices[0].flat is None:
                got = self.read_stored(entry, slices[0], inter.within(sbox), region if region.is_contiguous() else None)
                if got.data_ptr() != region.data_ptr():
                    region.copy_(got)
            else:
                self._read_span(entry, sbox, slices, inter, region)
        if flat is None:
            return full
        skip = flat[0] - (need[0][0] - box[0][0]) * math.prod(box.shape[1:])
        return full.view(-1)[skip:skip + flat[1] - flat[0]].clone()

    def _read_span(self, entry, sbox, pieces, inter, region) -> None:
        """Fill `region` (the box `inter`) from the flat pieces of the stored box `sbox`, reading from the
        pieces only the ranges of sbox that hold it (`read_ranges`)."""
        ranges = read_ranges(inter, sbox, entry.itemsize, self.man.block_bytes)
        buf = torch.empty(sum(b - a for a, b in ranges), dtype=entry.torch_dtype)
        at = 0
        for lo, hi in ranges:
            for sl in pieces:
                pa, pb = sl.flat
                x, y = max(lo, pa), min(hi, pb)
                if x < y:
                    part = buf[at + x - lo:at + y - lo]
                    got = self.read_flat(entry, sl, x - pa, y - pa, part)
                    if got.data_ptr() != part.data_ptr():
                        part.copy_(got)
            at += hi - lo
        # one range: the span, laid out as in sbox; several: the region's runs, in its row-major order
        region.copy_(buf.as_strided(inter.shape, _strides(sbox.shape)) if len(ranges) == 1 else buf.view(inter.shape))

    def _read_same_box(self, entry, box, stored, flat, out) -> torch.Tensor:
        """Elements flat[0]:flat[1] (None: all, shaped as the box) of a box stored whole or in pieces:
        read only the overlapping ranges, straight into `out` where it can land."""
        a, b = flat or (0, box.numel)
        dest = out.view(-1) if lands_in(out, entry.torch_dtype, b - a) else torch.empty(b - a, dtype=entry.torch_dtype)
        for sl in stored:
            pa, pb = sl.flat or (0, box.numel)
            lo, hi = max(a, pa), min(b, pb)
            if lo < hi:
                region = dest[lo - a:hi - a]
                got = self.read_flat(entry, sl, lo - pa, hi - pa, region)
                if got.data_ptr() != region.data_ptr():
                    region.copy_(got)
        return dest if flat is not None else dest.view(box.shape)
