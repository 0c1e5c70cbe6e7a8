"""One coordinate's folder written: its safetensors files streamed with their checksums, its state.json (and
any other small file of the payload: the run's tokenizer.json in tp00-pp00-dp00), fsynced.

The same function writes a rank's folder in a live save (commit.save_collective) and every coordinate's in
`split` and `reshard` (convert/resharding.py); it returns the report the commit merges into the manifest.
"""
from __future__ import annotations

from pathlib import Path

from ..base.fs import fsync_dir, write_new
from .manifest import FileRecord, RankReport, SliceRef, checksum_block
from .plan import Payload
from .stream import StreamingWriter, crc32c
from .tree import STATE_FILE


def write_rank(folder: Path, pay: Payload, rel: str) -> RankReport:
    """Write one coordinate's folder; return its report for the manifest (see manifest.build)."""
    block = checksum_block()
    folder.mkdir(parents=True, exist_ok=True)
    report = RankReport()
    crcs = {}
    for fname, tensors in pay.files.items():
        size, crc, crcs[fname] = _write_tensors(folder / fname, tensors, block)
        report.files[f"{rel}/{fname}"] = FileRecord(size, crc)
    data = pay.state.to_json()
    write_new(folder / STATE_FILE, data)
    report.files[f"{rel}/{STATE_FILE}"] = FileRecord(len(data), f"{crc32c(data):08x}")
    for name, data in pay.step_files.items():
        write_new(folder / name, data)
        report.files[f"{rel}/{name}"] = FileRecord(len(data), f"{crc32c(data):08x}")
    for proto, it in pay.records:
        sl = SliceRef(f"{rel}/{it.file}", it.key, it.box, it.flat, crcs[it.file][it.key])
        report.tensors.append((proto, sl))
    fsync_dir(folder)
    return report


def _write_tensors(path: Path, tensors: dict, block: int) -> tuple[int, str, dict]:
    """Stream one safetensors file (keys sorted: the same state gives the same bytes); return its size,
    its header's CRC32C and each tensor's block CRC32Cs, computed on the buffers as they are written."""
    keys = sorted(tensors)
    w = StreamingWriter(path, [(k, list(tensors[k].shape), tensors[k].dtype) for k in keys], {"format": "pt"},
                        block=block)
    try:
        crcs = {k: tuple(w.write(k, tensors[k])) for k in keys}
        w.close()
    except BaseException:
        w.abort()
        raise
    return w.size, f"{w.header_crc32c:08x}", crcs
