"""PyTorch Distributed Checkpoint (DCP) folders: read without running their pickles, and written in DCP's
pickle-free Hugging Face storage format.

In: a DCP folder is `.metadata` (a pickle of torch.distributed.checkpoint's Metadata: every tensor's dtype,
global shape and chunks, and for each chunk the file, byte offset and length that hold it) beside the files
(`__0_0.distcp`, ...) in which each chunk is a separate `torch.save` blob. Here `.metadata` goes through
the allow-list unpickler (unpickle.py), every field is type-checked, every file it names must lie inside
the folder, and each chunk is read with `torch.load(weights_only=True)` from exactly its recorded byte
range, which must lie within its file. Non-tensor entries (bytes: a dataloader or train state) are listed,
never unpickled. A tensor is assembled from the chunks that cover the region asked for, one tensor at a time.

Out: `write_dcp` writes what `HuggingFaceStorageWriter` writes for a rank-0 save (torch >= 2.8): one
safetensors file `model-00001-of-00001.safetensors`, its `DCP_SHARDING_INFO` / `DCP_VERSION` metadata, and
`model.safetensors.index.json`. `dcp.load(state_dict, storage_reader=HuggingFaceStorageReader(DIR))` reads
it into full or sharded (DTensor) state dicts, and no pickle is involved on either side.
"""
from __future__ import annotations

import io
import json
import math
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Iterable, Iterator, Optional

import torch

from ..base.fs import open_regular, path_kind, read_all
from ..base.errors import ConvertError
from ..base import limits
from ..checkpoint.stream import dtype_of
from . import unpickle
from .common import DCP_OUT, HF_FILE, HF_INDEX, Source, Spec

METADATA = ".metadata"

Region = tuple  # ((start, stop), ...) per dim


@dataclass(frozen=True)
class Chunk:
    offsets: tuple
    sizes: tuple
    file: str  # relative to the folder
    start: int  # byte range [start, start + length) of `file`
    length: int


@dataclass
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple
    chunks: list

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


# ---------------------------------------------------------------- .metadata -> typed index
def _rec(value, kind: str, where: str) -> unpickle.Record:
    if not isinstance(value, unpickle.Record) or not value.kind.endswith(kind):
        got = value.kind if isinstance(value, unpickle.Record) else type(value).__name__
        raise ConvertError(f"{where} is {got}, expected {kind}")
    return value


def _size(value, where: str) -> tuple:
    """torch.Size(...) as a tuple of non-negative int64 sizes whose product is an int64 too."""
    r = _rec(value, "torch.Size", where)
    dims = r.args[0] if len(r.args) == 1 and isinstance(r.args[0], (tuple, list)) else None
    if dims is None or len(dims) > limits.MAX_DEPTH or any(
            isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= limits.MAX_INT for d in dims) \
            or math.prod(dims) > limits.MAX_INT:
        raise ConvertError(f"{where} is torch.Size{limits.describe(r.args)}, expected at most {limits.MAX_DEPTH} "
                           f"non-negative integer sizes within int64")
    return tuple(dims)


def _int(value, where: str) -> int:
    return limits.number(value, where, ConvertError)


def _name(value, where: str) -> str:
    """A tensor name (a state_dict key): text that UTF-8 can write (a lone surrogate cannot be stored in a
    safetensors header, nor printed)."""
    if not isinstance(value, str):
        raise ConvertError(f"{where} is {type(value).__name__} {limits.describe(value)}, expected a tensor name")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConvertError(f"{where} {ascii(value[:60])} is not valid Unicode text ({e.reason} at character "
                           f"{e.start}); expected a tensor name that UTF-8 can write") from None
    return value


def _relative_file(value, where: str) -> str:
    """A file name inside the folder: relative, no '..', no NUL."""
    if not isinstance(value, str) or not value or "\x00" in value:
        raise ConvertError(f"{where} = {limits.describe(value)}, expected a file name inside the checkpoint folder")
    _name(value, where)
    p = PurePosixPath(value)
    if p.is_absolute() or ".." in p.parts:
        raise ConvertError(f"{where} = {value!r} points outside the checkpoint folder (expected a file name "
                           f"inside it)")
    return value


def _dtype(props, where: str) -> torch.dtype:
    r = _rec(props, "TensorProperties", where)
    state = r.state
    dtype = state[0] if isinstance(state, tuple) and state else r.fields().get("dtype")
    if not isinstance(dtype, torch.dtype):
        raise ConvertError(f"{where}.dtype = {limits.describe(dtype)}, expected a torch dtype")
    return dtype_of(dtype, where, ConvertError)


def read_index(folder: Path) -> tuple[dict[str, TensorInfo], list[str]]:
    """({tensor name: TensorInfo}, [names of the non-tensor (bytes) entries]) from folder/.metadata."""
    path = folder / METADATA
    if not path.is_file():
        raise ConvertError(f"{path}: is {path_kind(path)}, expected DCP's index file")
    limits.within(path.stat().st_size, "index", str(path), ConvertError)
    data = read_all(path, limits.FILE_BYTES["index"] + 1, follow=True)  # a FIFO refused at open, never waited on
    limits.within(len(data), "index", str(path), ConvertError)
    try:
        md = unpickle.load(data, unpickle.DCP_METADATA)
    except unpickle.OverBudget as e:
        raise ConvertError(f"{path}: {e}") from None
    except unpickle.RefusedGlobal as e:
        raise ConvertError(f"{path}: the pickle names '{e.name}', which is not one of the classes a DCP index "
                           f"holds; refusing to read it (nothing in it was run)") from None
    except Exception as e:  # noqa: BLE001 (any malformed pickle: one line naming the file)
        raise ConvertError(f"{path}: not a readable DCP index ({type(e).__name__}: {e})") from None
    f = _rec(md, "checkpoint.metadata.Metadata", str(path)).fields()
    entries, storage_data = f.get("state_dict_metadata"), f.get("storage_data")
    if not isinstance(entries, dict) or not isinstance(storage_data, dict):
        raise ConvertError(f"{path}: Metadata.state_dict_metadata / storage_data are missing (expected dicts)")
    storage = {}
    for idx, info in storage_data.items():
        key = _rec(idx, "MetadataIndex", f"{path}: a storage_data key").fields()
        fqn = _name(key.get("fqn"), f"{path}: a storage_data key's fqn")
        where = f"{path}: storage_data['{fqn}']"
        off = key.get("offset")
        s = _rec(info, "_StorageInfo", where).fields()
        if s.get("transform_descriptors"):
            raise ConvertError(f"{where} was written through DCP storage extension(s) "
                               f"{limits.describe(s['transform_descriptors'])}"
                               f" (e.g. compression); megalite reads only plain chunks")
        storage[(fqn, None if off is None else _size(off, f"{where}.offset"))] = (
            _relative_file(s.get("relative_path"), f"{where}.relative_path"),
            _int(s.get("offset"), f"{where}.offset"), _int(s.get("length"), f"{where}.length"))
    tensors, others = {}, []
    for name, entry in entries.items():
        name = _name(name, f"{path}: a state_dict_metadata key")
        where = f"{path}: tensor '{name}'"
        if isinstance(entry, unpickle.Record) and entry.kind.endswith("BytesStorageMetadata"):
            others.append(name)
            continue
        e = _rec(entry, "TensorStorageMetadata", where).fields()
        shape = _size(e.get("size"), f"{where}.size")
        chunks = []
        if not isinstance(e.get("chunks"), list):
            raise ConvertError(f"{where}.chunks is {type(e.get('chunks')).__name__}, expected a list")
        for c in e["chunks"]:
            cf = _rec(c, "ChunkStorageMetadata", f"{where}: a chunk").fields()
            offsets, sizes = _size(cf.get("offsets"), f"{where}: chunk offsets"), _size(cf.get("sizes"),
                                                                                         f"{where}: chunk sizes")
            if len(offsets) != len(shape) or len(sizes) != len(shape):
                raise ConvertError(f"{where}: chunk at {list(offsets)} of sizes {list(sizes)} does not have the "
                                   f"{len(shape)} dims of the tensor's size {list(shape)}")
            if (name, offsets) not in storage:
                raise ConvertError(f"{where}: chunk at {list(offsets)} has no storage_data entry (no file holds it)")
            chunks.append(Chunk(offsets, sizes, *storage[(name, offsets)]))
        info = TensorInfo(name, _dtype(e.get("properties"), f"{where}.properties"), shape, chunks)
        _check_backed(info, where)
        _check_tiling(info, where)
        tensors[name] = info
    return tensors, others


def _check_backed(t: TensorInfo, where: str) -> None:
    """Each chunk's declared elements fit the bytes recorded for it (a torch.save of a tensor holds at least
    its raw bytes), so no shape written in the index can make the reader allocate more than the files hold."""
    width = torch.empty((), dtype=t.dtype).element_size()
    for c in t.chunks:
        need = math.prod(c.sizes) * width
        if need > c.length:
            raise ConvertError(f"{where}: chunk at {list(c.offsets)} of sizes {list(c.sizes)} ({t.dtype}) needs "
                               f"{need:,} bytes, but {c.file} records only {c.length:,} for it")


def _check_tiling(t: TensorInfo, where: str) -> None:
    """The chunks lie inside the tensor, do not overlap, and together cover it."""
    for c in t.chunks:
        if any(o + s > n for o, s, n in zip(c.offsets, c.sizes, t.shape)):
            raise ConvertError(f"{where}: chunk at {list(c.offsets)} of sizes {list(c.sizes)} reaches past the "
                               f"tensor's size {list(t.shape)}")
    boxes = sorted((c.offsets, c.sizes) for c in t.chunks if math.prod(c.sizes))
    if sum(math.prod(s) for _, s in boxes) != math.prod(t.shape):
        raise ConvertError(f"{where}: its {len(t.chunks)} chunk(s) hold {sum(math.prod(s) for _, s in boxes)} "
                           f"elements, the tensor of size {list(t.shape)} has {math.prod(t.shape)}")
    active: list = []  # a sweep along dim 0: only chunks whose dim-0 ranges overlap are compared
    for off, size in boxes:
        active = [(o, s) for o, s in active if o[0] + s[0] > off[0]]
        for o, s in active:
            if all(a < c + d and c < a + b for a, b, c, d in zip(off, size, o, s)):
                raise ConvertError(f"{where}: chunks at {list(o)} and {list(off)} overlap")
        active.append((off, size))


# ---------------------------------------------------------------- reading chunks
class _Window(io.RawIOBase):
    """Bytes [start, start + length) of an open file as a seekable file of its own (positioned reads, so
    nothing outside the range can be read through it)."""

    def __init__(self, fd: int, start: int, length: int):
        super().__init__()
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, pos, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        if n == 0:
            return 0
        with memoryview(b) as mv:
            got = os.preadv(self.fd, [mv[:n]], self.start + self.pos)
        self.pos += got
        return got


def _stored_records(fd: int, c: Chunk, where: str) -> None:
    """The chunk's torch.save archive holds only stored (uncompressed) records, of at most its own length in
    all: torch.save never compresses, and a DEFLATE record of 1 MiB inflates to gigabytes before torch.load
    could check a size."""
    try:
        with zipfile.ZipFile(io.BufferedReader(_Window(fd, c.start, c.length))) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise ConvertError(f"{where} are not a tensor that torch.load(weights_only=True) reads (not a torch.save "
                           f"archive: {limits.describe(str(e), 80)})") from None
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise ConvertError(f"{where}: record '{limits.describe(info.filename)}' is compressed (zip method "
                               f"{info.compress_type}, {info.file_size:,} bytes inflated); torch.save stores "
                               f"records uncompressed, and megalite reads only such")
    total = sum(i.file_size for i in infos)
    if total > c.length:
        raise ConvertError(f"{where}: its records declare {total:,} bytes, more than the chunk's {c.length:,}")


class DcpFolder(Source):
    """A DCP checkpoint folder as a Source: its typed index, and tensors (or regions of them) read chunk by
    chunk. A plain DCP folder does not say which model its tensors make (`model` None): its tensors keep their
    stored names and dtypes. Non-tensor entries are `skipped` (never unpickled)."""

    def __init__(self, folder):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise ConvertError(f"'{self.folder}' is {path_kind(self.folder)}, expected a DCP checkpoint folder")
        self.where, self.guards = str(self.folder), [self.folder]
        self.root = Path(os.path.realpath(self.folder))
        self.tensors, self.others = read_index(self.folder)
        self.skipped = self.others
        self.specs = {n: Spec(tuple(t.shape), t.dtype) for n, t in self.tensors.items()}
        self._check_files()

    def _check_files(self) -> None:
        """Every chunk's byte range lies within its file, checked once per file before any chunk is read: the
        index's lengths (which bound every shape, _check_backed) are then backed by bytes on disk."""
        sizes: dict[str, int] = {}
        for t in self.tensors.values():
            for c in t.chunks:
                if c.file not in sizes:
                    fd = self._open(c.file)
                    try:
                        sizes[c.file] = os.fstat(fd).st_size
                    finally:
                        os.close(fd)
                if c.start + c.length > sizes[c.file]:
                    raise ConvertError(f"{self.folder / c.file}: bytes {c.start}-{c.start + c.length} (chunk "
                                       f"{list(c.offsets)} of '{t.name}') end past the file's {sizes[c.file]} bytes "
                                       f"(a truncated file, or an index that does not match it)")

    def _open(self, rel: str) -> int:
        path = self.folder / rel
        real = Path(os.path.realpath(path))
        if self.root not in real.parents:
            raise ConvertError(f"{self.folder / METADATA}: chunk file '{rel}' resolves to {real}, outside the "
                               f"checkpoint folder (a symlink?); refusing to read it")
        if not real.is_file():
            raise ConvertError(f"{path}: is {path_kind(path)}, expected a chunk file of the checkpoint")
        return open_regular(real, os.O_RDONLY)  # resolved above; a FIFO put there since is still refused at open

    def _chunk(self, t: TensorInfo, c: Chunk) -> torch.Tensor:
        fd = self._open(c.file)
        try:
            size = os.fstat(fd).st_size
            where = (f"{self.folder / c.file}: bytes {c.start}-{c.start + c.length} (chunk {list(c.offsets)} of "
                     f"'{t.name}')")
            if c.start + c.length > size:
                raise ConvertError(f"{where} end past the file's {size} bytes (a truncated file, or an index that "
                                   f"does not match it)")
            _stored_records(fd, c, where)
            try:
                out = torch.load(io.BufferedReader(_Window(fd, c.start, c.length), 1 << 20), map_location="cpu",
                                 weights_only=True)
            except Exception as e:  # noqa: BLE001 (whatever torch.load raises on bad bytes: one line)
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise ConvertError(f"{where} are not a tensor that torch.load(weights_only=True) reads ({first})") \
                    from None
        finally:
            os.close(fd)
        if not isinstance(out, torch.Tensor) or out.dtype != t.dtype or tuple(out.shape) != c.sizes:
            got = f"{out.dtype} {list(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise ConvertError(f"{where} hold {got}, the index says {t.dtype} {list(c.sizes)}")
        return out

    def read(self, name: str, region: Optional[Region] = None) -> torch.Tensor:
        """The tensor `name`, or its `region` ((start, stop) per dim), from the chunks that cover it."""
        t = self.tensors[name]
        region = region or tuple((0, n) for n in t.shape)
        shape = tuple(b - a for a, b in region)
        if not math.prod(shape):
            return torch.empty(shape, dtype=t.dtype)
        out = None
        for c in t.chunks:
            lo = [max(a, o) for (a, _), o in zip(region, c.offsets)]
            hi = [min(b, o + s) for (_, b), o, s in zip(region, c.offsets, c.sizes)]
            if any(x >= y for x, y in zip(lo, hi)):
                continue
            piece = self._chunk(t, c)
            if tuple(c.offsets) == tuple(a for a, _ in region) and tuple(c.sizes) == shape:
                return piece  # one chunk is exactly the region: no copy
            if out is None:
                out = torch.empty(shape, dtype=t.dtype)
            src = tuple(slice(x - o, y - o) for x, y, o in zip(lo, hi, c.offsets))
            dst = tuple(slice(x - a, y - a) for x, y, (a, _) in zip(lo, hi, region))
            out[dst] = piece[src]
            del piece
        return out

    def pieces(self, name: str) -> Iterator[torch.Tensor]:
        """The tensor as consecutive pieces of its row-major bytes: its chunks themselves, one at a time, when
        they split it along dim 0 only (FSDP / torchtitan Shard(0), column-parallel weights); else the
        whole tensor assembled by read()."""
        t = self.tensors[name]
        rows = [c for c in t.chunks if math.prod(c.sizes)]
        if t.shape and all(c.offsets[1:] == (0,) * (len(t.shape) - 1) and c.sizes[1:] == t.shape[1:] for c in rows):
            for c in sorted(rows, key=lambda c: c.offsets[0]):
                yield self._chunk(t, c)
        else:
            yield self.read(name)


# ---------------------------------------------------------------- writing
def write_dcp(tmp: Path, specs: list, tensors: Iterable[tuple[str, list]], extra_meta: dict, write_file) -> None:
    """specs [(name, shape, dtype)] and (name, pieces) in that order -> a DCP checkpoint folder at `tmp` in the
    Hugging Face storage format (what HuggingFaceStorageWriter writes from rank 0). `write_file(path, specs,
    tensors, meta)` writes its one safetensors file (sink.py's)."""
    tmp.mkdir(parents=True)
    sharding = {name: {"saved_offsets": [0] * len(shape)} for name, shape, _ in specs}
    meta = {"format": "pt", "DCP_SHARDING_INFO": json.dumps(sharding), "DCP_VERSION": "1.0", **extra_meta,
            DCP_OUT: "dcp"}  # the marker by which `convert --force` knows a folder it may replace
    write_file(tmp / HF_FILE, specs, tensors, meta)
    index = {"metadata": {"total_size": (tmp / HF_FILE).stat().st_size},
             "weight_map": {name: HF_FILE for name, _, _ in specs}}
    (tmp / HF_INDEX).write_text(json.dumps(index, indent=2) + "\n")
