"""safetensors files written and read one tensor at a time, straight from and into tensor memory.

The safetensors library serialises a whole file into one bytes object before writing (a full extra copy
of the state, and the CPU time to make it) and has no incremental writer; its reader memory-maps files.
Checkpoints and the converter stream instead: the header (8-byte little-endian length, then JSON with each
tensor's dtype, shape and byte offsets, space-padded to 8 bytes: the documented format) is laid out from
the known shapes, then each tensor's bytes are written from its own memory, with the CRC32s computed on
the same buffer. Files are read back by the safetensors library itself in the tests, and partial reads
still go through `safe_open(...).get_slice`.
"""
from __future__ import annotations

import json
import math
import os
import zlib
from pathlib import Path

import torch

ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_FROM_ST = {v: k for k, v in ST_DTYPES.items()}


def _bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


class StreamingWriter:
    """Write tensors in the order of `specs` [(name, shape, dtype)]; with `checksum`, `crc32` covers the
    whole file and `write` returns each tensor's CRC32 (the converter's outputs need neither)."""

    def __init__(self, path: Path, specs: list[tuple[str, list, torch.dtype]], metadata: dict,
                 checksum: bool = True):
        self.path, self.specs, self.checksum = Path(path), specs, checksum
        header, offset = {"__metadata__": metadata}, 0
        for name, shape, dtype in specs:
            n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        head = len(blob).to_bytes(8, "little") + blob
        self.f = open(self.path, "wb")
        self.f.write(head)
        self.crc32 = zlib.crc32(head)
        self.size = len(head) + offset
        self.next = 0

    def write(self, name: str, t: torch.Tensor) -> int:
        """Append tensor `name`; return the CRC32 of its bytes (0 without checksum)."""
        want, shape, dtype = self.specs[self.next]
        if name != want or list(t.shape) != list(shape) or t.dtype != dtype:
            raise ValueError(f"writer expected {want} {shape} {dtype}, got {name} {list(t.shape)} {t.dtype}")
        data = _bytes(t.detach().cpu())
        self.f.write(data)
        self.next += 1
        if not self.checksum:
            return 0
        self.crc32 = zlib.crc32(data, self.crc32)
        return zlib.crc32(data)

    def close(self, fsync: bool = True) -> None:
        self.f.flush()
        if fsync:
            os.fsync(self.f.fileno())
        self.f.close()

    def abort(self) -> None:
        self.f.close()
        self.path.unlink(missing_ok=True)


def read_header(path: Path) -> tuple[dict, int]:
    """(header without __metadata__, byte offset where tensor data starts); no tensor bytes are read."""
    with open(path, "rb") as f:
        raw = f.read(8)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if n <= 0 or n > 100_000_000:
            raise ValueError(f"header length {n}")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def read_into(path: Path, entry: dict, data_start: int, out: torch.Tensor) -> None:
    """Read one whole stored tensor straight into `out` (a contiguous CPU tensor of its dtype and size)."""
    if _FROM_ST.get(entry["dtype"]) != out.dtype:
        raise ValueError(f"stored dtype {entry['dtype']}, expected {ST_DTYPES.get(out.dtype)}")
    a, b = entry["data_offsets"]
    buf = _bytes(out)
    if len(buf) != b - a:
        raise ValueError(f"stored {b - a} bytes, expected {len(buf)}")
    with open(path, "rb", buffering=0) as f:
        f.seek(data_start + a)
        got = f.readinto(buf)
    if got != b - a:
        raise ValueError(f"file ends after {got} of {b - a} bytes")
