"""The loader's checks run without loading: `verify` (for `megalite verify`, resume=auto's choice, and the
commit's `recover`, which moves in an interrupted re-save only if it verifies), and the checked read of a
whole small file of a step (state.json) that the loader and `verify` share.

`verify` runs the same manifest parser (every field, paths, dtypes, exact tiling, the manifest's checksum),
the same file checks (no symlinks, sizes, header checksums and well-formed headers), the same key/dtype/shape
checks, and every checksum block of every slice, every state.json and the tokenizer.json. So a checkpoint `verify` calls intact
is one every loader accepts, and any checkpoint problem a loader would refuse, `verify` reports.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..base.errors import CheckpointError
from ..base.fs import read_all
from .manifest import Manifest, read
from .read import SliceReader, check_key
from .state import StepState
from .stream import crc32c
from .tree import MANIFEST, STATE_FILE, coord_dir, resolve, tokenizer_rel


def read_checked(step: Path, man: Manifest, rel: str) -> bytes:
    """A small file of the step read whole, checked against the size and CRC32C the manifest records."""
    path, rec = step / rel, man.files[rel]
    if path.is_symlink() or path.parent.is_symlink():
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


def verify(path, data: bool = True) -> tuple[Path, list[str]]:
    """Every problem, one line each: the manifest, then per coordinate, per file and per tensor slice.
    `data=False` (the commit's check of what it is about to commit) skips reading the tensors' bytes: every
    file is still there, a regular file of its coordinate's folder, of its size, with its header checksum (and
    every state.json whole), which is what a rank that wrote somewhere else would leave missing."""
    try:
        step = resolve(path)
        man = read(step)
    except CheckpointError as e:
        return Path(path), [str(e)]
    problems = []
    for c in man.layout.coords():
        rel = coord_dir(c, man.layout.cp)
        if not (step / rel).is_dir():
            problems.append(f"{step.name}: folder {rel}/ is missing (layout {man.layout} expects it)")
            continue
        try:
            read_state(step, man, c)
        except CheckpointError as e:
            problems.append(str(e))
    try:
        read_tokenizer(step, man)
    except CheckpointError as e:
        problems.append(str(e))
    reader = SliceReader(step, man)
    bad_files = set()
    for rel in man.files:
        if rel.endswith(".safetensors"):
            try:
                reader.header(rel)
            except CheckpointError as e:
                problems.append(str(e))
                bad_files.add(rel)
    for entry in man.tensors():
        for sl in entry.slices:
            if sl.file in bad_files:
                continue
            try:
                check_key(step, reader.header(sl.file)[0], entry, sl)
                if data:
                    reader.read_stored(entry, sl)  # all its blocks, checked
            except CheckpointError as e:
                problems.append(str(e))
    return step, problems


def complete(folder: Path) -> bool:
    """A step folder with a manifest that verifies (what the commit's `recover` may move into place)."""
    return (folder / MANIFEST).is_file() and not verify(folder)[1]
