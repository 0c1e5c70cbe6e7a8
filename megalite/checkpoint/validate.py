"""The checkpoint's validation home: every check a file of a step must pass before any of it is used, shared by
the loader (load.py, read.py) and `verify` (verify.py, which runs them all without loading; the commit's `recover`
asks it before moving an interrupted re-save in).

    read_checked(step, man, rel)   a small file read whole, checked against its size and CRC32C (state.json,
                                   tokenizer.json, origin.json); read_state, read_tokenizer, read_origin
    check_file(step, rel, man)     a safetensors file as the loader opens it: inside the step folder (no link),
                                   the manifest's size, a well-formed header whose CRC32C matches
    check_key(step, header, ...)   a slice's key in its file, with the manifest's dtype and stored shape
Each block of tensor bytes is checked as it is read (read.py's SliceReader).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..base.errors import CheckpointError, DataError
from ..base.fs import linked, read_all
from ..base.origin import Origin
from .manifest import Manifest, SliceRef, TensorEntry, read as read_manifest
from .state import StepState
from .stream import check_header, crc32c, read_header, read_metadata, st_dtype
from .tree import LATEST, MANIFEST, STATE_FILE, coord_dir, origin_rel, resolve, tokenizer_rel
from ..tokenizer import TOKENIZER_JSON, TOKENIZER_KEY, Tokenizer, from_json, load


def read_checked(step: Path, man: Manifest, rel: str) -> bytes:
    """A small file of the step read whole, checked against the size and CRC32C the manifest records."""
    path, rec = step / rel, man.files[rel]
    if linked(path, parents=1):
        raise CheckpointError(f"{step.name}: {rel} is a symbolic link (refused: files must live in the step folder)")
    try:
        data = read_all(path)
    except FileNotFoundError:
        raise CheckpointError(f"{step.name}: {rel} is missing") from None
    except OSError as e:
        raise CheckpointError(f"{step.name}: {rel} cannot be read ({e.strerror or e})") from None
    if len(data) != rec.bytes or f"{crc32c(data):08x}" != rec.crc32c:
        raise CheckpointError(f"{step.name}: {rel} fails its checksum ({len(data)} bytes, crc32c "
                              f"{crc32c(data):08x}; the manifest says {rec.bytes} bytes, crc32c {rec.crc32c})")
    return data


def read_state(step: Path, man: Manifest, coord) -> StepState:
    """One coordinate's state.json, checked (read_checked) and parsed (StepState.from_json)."""
    rel = f"{coord_dir(coord, man.layout.cp)}/{STATE_FILE}"
    return StepState.from_json(read_checked(step, man, rel), f"{step.name}: {rel}")


def read_tokenizer(step: Path, man: Manifest) -> Optional[bytes]:
    """The run's tokenizer.json, checked (read_checked); None for a checkpoint saved without one (older, or
    saved by the API without `tokenizer`)."""
    rel = tokenizer_rel(man.layout.cp)
    return read_checked(step, man, rel) if rel in man.files else None


def read_origin(step: Path, man: Manifest) -> Optional[Origin]:
    """The model's origin.json (base/origin.py), checked (read_checked) and parsed; None where the step has none."""
    rel = origin_rel(man.layout.cp)
    if rel not in man.files:
        return None
    return Origin.from_json(read_checked(step, man, rel), f"{step.name}: {rel}")


def carried_by(path) -> Optional[Tokenizer]:
    """The tokenizer a model artifact carries, or None where it carries none: a checkpoint (root or step
    folder: its tokenizer.json, checked against the manifest), a converted model file (its safetensors metadata
    TOKENIZER_KEY), an HF folder (its tokenizer.json, else GPT-2's vocab.json + merges.txt). The checkpoint side
    of that question: tokenizer.py reads tokenizers and opens no checkpoint."""
    p = Path(path)
    if p.is_dir() and ((p / MANIFEST).exists() or (p / LATEST).exists()):  # a checkpoint, not an HF folder
        step = resolve(p)
        man = read_manifest(step)
        text, where = read_tokenizer(step, man), f"{step / tokenizer_rel(man.layout.cp)}"
    elif p.is_dir():
        return load(p, "model folder") if (p / TOKENIZER_JSON).exists() or (p / "vocab.json").exists() else None
    else:
        try:
            text = read_metadata(p).get(TOKENIZER_KEY)
        except (OSError, ValueError) as e:
            raise DataError(f"{p}: cannot read its safetensors metadata ({e})") from None
        where = f"{p}: metadata '{TOKENIZER_KEY}'"
    if text is None:
        return None
    return from_json(text if isinstance(text, str) else text.decode("utf-8", errors="replace"), where)


def check_file(step: Path, rel: str, man: Manifest) -> tuple[dict, int]:
    """Open one safetensors file of the step as the loader does: a regular file inside the step folder,
    the size the manifest says, a well-formed header whose CRC32C matches. Returns (header, data start)."""
    path, rec = step / rel, man.files[rel]
    if linked(path, parents=1):
        raise CheckpointError(f"{step.name}: {rel} is a symbolic link (refused: files must live in the step folder)")
    if not path.is_file():
        raise CheckpointError(f"{step.name}: shard {rel} is missing (layout {man.layout} expects it)")
    size = path.stat().st_size
    if size != rec.bytes:
        raise CheckpointError(f"{step.name}: {rel} is {size} bytes, the manifest says {rec.bytes} "
                              f"(truncated or replaced?)")
    try:
        header, start, crc = read_header(path)
    except (ValueError, UnicodeDecodeError) as e:  # a damaged header, or not safetensors at all
        raise CheckpointError(f"{step.name}: {rel} is not a readable safetensors file ({e})") from None
    if f"{crc:08x}" != rec.crc32c:
        raise CheckpointError(f"{step.name}: {rel} fails its header checksum (crc32c {crc:08x}, manifest "
                              f"{rec.crc32c}): the file is corrupted")
    try:
        check_header(header, start, size)
    except ValueError as e:
        raise CheckpointError(f"{step.name}: {rel} has a bad safetensors header ({e})") from None
    return header, start


def check_key(step: Path, header: dict, entry: TensorEntry, sl: SliceRef) -> dict:
    """The slice's key is in its file with the manifest's dtype and stored shape."""
    h = header.get(sl.key)
    if h is None:
        raise CheckpointError(f"{step.name}: tensor '{entry.name}' (key '{sl.key}') is missing from {sl.file}")
    if list(h["shape"]) != sl.shape:
        raise CheckpointError(f"{step.name}: tensor '{entry.name}' in {sl.file} has shape {list(h['shape'])}, "
                              f"the manifest says {sl.shape}")
    if h["dtype"] != st_dtype(entry.torch_dtype):
        raise CheckpointError(f"{step.name}: tensor '{entry.name}' in {sl.file} is stored as {h['dtype']}, "
                              f"the manifest says {entry.dtype}")
    return h
