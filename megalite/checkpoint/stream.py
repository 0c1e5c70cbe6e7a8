"""safetensors files written and read one tensor at a time, straight from and into tensor memory.

The safetensors library serialises a whole file into one bytes object before writing (a full extra copy
of the state, and the CPU time to make it) and has no incremental writer; its reader memory-maps files.
Checkpoints and the converter stream instead: the header (8-byte little-endian length, then JSON with each
tensor's dtype, shape and byte offsets, space-padded to 8 bytes: the documented format) is laid out from
the known shapes, then each tensor's bytes are written from its own memory, with the CRC32Cs computed on
the same buffer. Files are read back by the safetensors library itself in the tests, and partial reads
still go through `safe_open(...).get_slice`.
"""
from __future__ import annotations

import errno
import fcntl
import json
import math
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from crc32c import crc32c as _crc32c

from ..base.jsonio import loads
from ..base.fs import no_follow, open_read

# The one dtype table of every reader and writer (checkpoints, the converter's sources and sinks): torch's
# dtypes megalite reads and writes, by safetensors' names; a name or a dtype outside it is refused, never
# taken for float32 (dtype_of).
ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}  # safetensors' names
_FROM_ST = {v: k for k, v in ST_DTYPES.items()}


def dtype_of(name, where: str, error: type) -> torch.dtype:
    """The torch dtype a stored tensor has: `name` is safetensors' (`"BF16"`) or a torch dtype (a DCP index's);
    one outside ST_DTYPES is `error` naming `where`."""
    dtype = name if isinstance(name, torch.dtype) else _FROM_ST.get(name) if isinstance(name, str) else None
    if dtype not in ST_DTYPES:
        raise error(f"{where}: dtype {name if isinstance(name, torch.dtype) else repr(name)[:40]}, expected one "
                    f"of {', '.join(_FROM_ST)} (the dtypes megalite reads)")
    return dtype
WRITABLE = ST_DTYPES  # what a StreamingWriter can write (convert/foreign.py): every dtype a checkpoint reads back


def crc32c(data, value: int = 0) -> int:
    """CRC32C (Castagnoli, as iSCSI, ext4 and HDFS use) of a bytes-like object, continuing from `value`;
    hardware-accelerated (SSE4.2 / ARMv8) by the `crc32c` package, with the GIL released."""
    return _crc32c(data, value)


def block_crcs(data, block: int) -> list[str]:
    """CRC32C of each `block`-byte chunk of `data` (the last may be short), as hex."""
    mv = memoryview(data).cast("B")
    return [f"{crc32c(mv[i:i + block]):08x}" for i in range(0, len(mv), block)]


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor, without a copy (writable: reads land in it)."""
    flat = t.contiguous().reshape(-1)  # 1-d: a 0-dim tensor (an optimizer's step) cannot be viewed as bytes
    return memoryview(flat.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


ALIGN = 4096  # O_DIRECT: file offsets, lengths and memory addresses in multiples of the logical block (<= 4 KiB)
BOUNCE = 8 << 20  # bytes per bounce buffer


def _open_direct(path: Path):
    """`path` opened for writing with O_DIRECT (unbuffered, through builtins.open and `files.no_follow`), or None
    where the file system refuses O_DIRECT at open (EINVAL) or the platform has no O_DIRECT."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return open(path, "wb", buffering=0, opener=lambda p, flags: no_follow(p, flags | flag))
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return None


class _DirectSink:
    """A file's bytes written with O_DIRECT: copied into two page-aligned (mmap) bounce buffers and written
    in whole ALIGN-multiple chunks by one writer thread, so copying the next chunk overlaps writing this one
    (the write releases the GIL). O_DIRECT skips the page cache: no dirty-page writeback throttling the
    writer, and no file-sized copy in the cache evicting what other jobs use. The last chunk is zero-padded
    to ALIGN and the file then cut to its exact size. A file system that takes the flag at open but refuses
    the first write (EINVAL) loses the flag (fcntl) and the same chunks go through the page cache: the bytes
    are the same."""

    def __init__(self, f, path: Path):
        self.f, self.path = f, path
        self.bufs = [mmap.mmap(-1, BOUNCE) for _ in range(2)]  # page-aligned, as O_DIRECT needs
        self.cur = self.fill = self.written = 0
        self.direct = True  # False once the file system refused the first O_DIRECT write
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megalite-direct-write")
        self.pending = None  # the write of the other buffer, if one is in flight

    def put(self, data: memoryview) -> None:
        pos = 0
        while pos < len(data):
            buf = self.bufs[self.cur]
            n = min(len(buf) - self.fill, len(data) - pos)
            buf[self.fill:self.fill + n] = data[pos:pos + n]
            self.fill, pos = self.fill + n, pos + n
            if self.fill == len(buf):
                self._ship(len(buf))

    def _ship(self, n: int) -> None:
        """Write the current buffer's first `n` bytes (an ALIGN multiple) in the background; switch buffers."""
        job = self.pool.submit(self._write, self.bufs[self.cur], n)
        self._wait()  # the other buffer's write: done before that buffer is filled again
        self.pending, self.cur, self.fill = job, self.cur ^ 1, 0

    def _wait(self) -> None:
        job, self.pending = self.pending, None
        if job is not None:
            job.result()

    def _write(self, buf: mmap.mmap, n: int) -> None:
        done = 0
        while done < n:
            with memoryview(buf) as whole:
                try:
                    k = self.f.write(whole[done:n])
                except OSError as e:
                    if e.errno != errno.EINVAL or self.written or not self._drop_direct():
                        raise
                    continue
            if not k:
                raise OSError(errno.ENOSPC, f"the disk took 0 of {n - done} bytes", str(self.path))
            done += k
            self.written += k

    def _drop_direct(self) -> bool:
        """Clear O_DIRECT on the open file (Linux allows it with F_SETFL); False if it was not set."""
        fd = self.f.fileno()
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        if not flags & os.O_DIRECT:
            return False
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        self.direct = False
        return True

    def close(self, size: int, fsync: bool) -> None:
        try:
            tail = -self.fill % ALIGN
            self.bufs[self.cur][self.fill:self.fill + tail] = bytes(tail)
            if self.fill:
                self._ship(self.fill + tail)
            self._wait()
            os.ftruncate(self.f.fileno(), size)  # the padding of the last chunk cut off
            if fsync:
                os.fsync(self.f.fileno())
        finally:
            self.abort()

    def abort(self) -> None:
        """Wait for the write in flight (its error, if any, is dropped: the caller is failing already)."""
        try:
            self._wait()
        except OSError:
            pass
        finally:
            self.pool.shutdown()
            self.f.close()
            self.bufs = []  # unmapped once no view of them is left


class StreamingWriter:
    """Write tensors in the order of `specs` [(name, shape, dtype)]. With `checksum`, `header_crc32c` covers
    the header (8-byte length + JSON) and `write` returns the CRC32C of each `block`-byte chunk of the
    tensor's bytes: together they cover every byte of the file (the converter's outputs need neither).
    With `direct`, the bytes go to the disk with O_DIRECT (see _DirectSink), where the file system allows it,
    and through the page cache otherwise; the file's bytes are the same either way."""

    def __init__(self, path: Path, specs: list[tuple[str, list, torch.dtype]], metadata: dict,
                 checksum: bool = True, block: int = 1 << 20, direct: bool = False):
        self.path, self.specs, self.checksum, self.block = Path(path), specs, checksum, block
        header, offset = {"__metadata__": metadata}, 0
        for name, shape, dtype in specs:
            n = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": WRITABLE[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        head = len(blob).to_bytes(8, "little") + blob
        # never through a symlink at `path` (it would overwrite whatever it points to): ELOOP instead
        f = _open_direct(self.path) if direct else None
        self.sink = _DirectSink(f, self.path) if f is not None else None
        self.f = f if f is not None else open(self.path, "wb", opener=no_follow)
        self._put(memoryview(head))
        self.header_crc32c = crc32c(head)
        self.size = len(head) + offset
        self.next = 0

    def write(self, name: str, t: torch.Tensor) -> list[str]:
        """Append tensor `name`; return the CRC32Cs of its blocks ([] without checksum)."""
        want, shape, dtype = self.specs[self.next]
        if name != want or list(t.shape) != list(shape) or t.dtype != dtype:
            raise ValueError(f"writer expected {want} {shape} {dtype}, got {name} {list(t.shape)} {t.dtype}")
        data = raw_bytes(t.detach().cpu())
        self._put(data)
        self.next += 1
        if not self.checksum:
            return []
        return block_crcs(data, self.block)

    def _put(self, data: memoryview) -> None:
        if self.sink is not None:
            self.sink.put(data)
        else:
            self.f.write(data)

    def close(self, fsync: bool = True) -> None:
        if self.sink is not None:
            self.sink.close(self.size, fsync)
            return
        self.f.flush()
        if fsync:
            os.fsync(self.f.fileno())
        self.f.close()

    def abort(self) -> None:
        if self.sink is not None:
            self.sink.abort()
        else:
            self.f.close()
        self.path.unlink(missing_ok=True)


def _raw_header(path: Path) -> tuple[bytes, bytes, dict]:
    """The 8 length bytes, the header's bytes and the header parsed (a regular file read, never a link)."""
    with open_read(path) as f:
        raw = f.read(8)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if n <= 0 or n > 100_000_000:
            raise ValueError(f"header length {n}")
        blob = f.read(n)
    if len(blob) != n:
        raise ValueError(f"header of {n} bytes, the file ends after {len(blob)}")
    header = loads(blob, "its header", ValueError)
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return raw, blob, header


def read_header(path: Path) -> tuple[dict, int, int]:
    """(header without __metadata__, byte offset where tensor data starts, CRC32C of the header bytes);
    no tensor bytes are read. Raises ValueError on anything that is not a safetensors header."""
    raw, blob, header = _raw_header(path)
    header.pop("__metadata__", None)
    return header, 8 + len(blob), crc32c(blob, crc32c(raw))


def read_metadata(path: Path) -> dict:
    """A safetensors file's __metadata__ (string to string); ValueError if it is not a safetensors file."""
    meta = _raw_header(path)[2].get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise ValueError("__metadata__ is not a JSON object")
    return meta


def check_header(header: dict, data_start: int, file_size: int) -> None:
    """Every entry well-formed (known dtype, shape, offsets matching them) and the entries' byte ranges
    tiling the data region exactly: no overlap, no gap, nothing past the end. Raises ValueError."""
    spans = []
    for key, e in header.items():
        if not isinstance(e, dict) or e.get("dtype") not in _FROM_ST:
            raise ValueError(f"key '{key}' has dtype {e.get('dtype') if isinstance(e, dict) else e!r}, "
                             f"expected one of {', '.join(_FROM_ST)}")
        shape, offs = e.get("shape"), e.get("data_offsets")
        if not isinstance(shape, list) or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in shape):
            raise ValueError(f"key '{key}' has shape {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2 or any(isinstance(x, bool) or not isinstance(x, int)
                                                                 for x in offs) or not 0 <= offs[0] <= offs[1]):
            raise ValueError(f"key '{key}' has data_offsets {offs!r}")
        n = math.prod(shape) * _FROM_ST[e["dtype"]].itemsize
        if offs[1] - offs[0] != n:
            raise ValueError(f"key '{key}' has data_offsets {offs} ({offs[1] - offs[0]} bytes) for {n} bytes of "
                             f"{e['dtype']} {shape}")
        spans.append((offs[0], offs[1], key))
    pos = 0
    for a, b, key in sorted(spans):
        if a != pos:
            raise ValueError(f"key '{key}' starts at byte {a}, expected {pos} "
                             f"({'overlapping' if a < pos else 'a gap after'} the previous tensor)")
        pos = b
    if data_start + pos != file_size:
        raise ValueError(f"the tensors end at byte {data_start + pos} of a {file_size}-byte file")


def st_dtype(dtype: torch.dtype) -> str:
    return ST_DTYPES[dtype]


def read_at(f, offset: int, out) -> None:
    """Read exactly len(out) bytes at `offset` of the open file `f` into the writable buffer `out`: positioned
    reads (pread, the GIL released), so one open file serves every read of a load, in any order."""
    buf, fd = memoryview(out).cast("B"), f.fileno()
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if not n:
            raise ValueError(f"file ends after {offset + got} bytes, {len(buf) - got} more expected")
        got += n
