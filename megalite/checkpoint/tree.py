"""The rank-coded checkpoint tree, and nothing else: names, paths, the `latest` pointer, who writes what.

    <root>/
      latest                        one line: the name of the newest committed step folder
      step_00000200/
        manifest.json               the whole picture (manifest.py)
        tp00-pp00-dp00/             written only by the rank at that coordinate
          model.safetensors         its share of the (tp, pp) model slice (range dp of its flat space)
          optimizer.safetensors     its share of the optimizer state (the same share of its AdamW moments)
          state.json                RNG states, sampler position, step
          tokenizer.json            the run's tokenizer (tp00-pp00-dp00 only: rank 0 writes it)
      .tmp-step_00000200/           a save in progress (renamed into place on commit)

Every function here has its inverse next to it, and both are unit-tested.
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from ..errors import CheckpointError  # noqa: F401  (re-exported: megalite.checkpoint.CheckpointError)
from ..parallel.grid import Coord, Layout
from ..parallel.data import dp_pieces
from ..parallel.partition import Box, Partition, tp_box  # noqa: F401  (Box: re-exported)

MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
TOKENIZER_FILE = "tokenizer.json"  # in tp00-pp00-dp00/ only (see TOKENIZER_REL)
TOKENIZER_REL = f"tp00-pp00-dp00/{TOKENIZER_FILE}"  # coord_dir(Coord(0, 0, 0)): a folder every layout has
LATEST = "latest"
LATEST_TMP = ".latest.tmp"
LOCK = "lock"
TMP_PREFIX = ".tmp-"

_COORD_RE = re.compile(r"^tp(\d{2,})-pp(\d{2,})-dp(\d{2,})$")
_STEP_RE = re.compile(r"^step_(\d{8,})$")


def coord_dir(c: Coord) -> str:
    return f"tp{c.tp:02d}-pp{c.pp:02d}-dp{c.dp:02d}"


def parse_coord_dir(name: str) -> Coord:
    m = _COORD_RE.match(name)
    if not m:
        raise ValueError(f"'{name}' is not a coordinate folder (expected tpNN-ppNN-dpNN)")
    return Coord(int(m[1]), int(m[2]), int(m[3]))


def step_dir(step: int) -> str:
    return f"step_{step:08d}"


def parse_step_dir(name: str) -> Optional[int]:
    m = _STEP_RE.match(name)
    return int(m[1]) if m else None


def tmp_dir(step: int) -> str:
    return TMP_PREFIX + step_dir(step)


def committed_steps(root: Path) -> list[int]:
    """Steps with a committed folder under root (a real folder, not a symlink, with a manifest), oldest first.

    Oldest means: steps above the one `latest` names come first (a run that rolled back with
    resume=PATH abandoned them), then the rest in step order. So resume=auto's fallback prefers this run's.
    """
    if not root.is_dir():
        return []
    steps = sorted(s for s in (parse_step_dir(p.name) for p in root.iterdir()
                               if not p.is_symlink() and (p / MANIFEST).is_file()) if s is not None)
    try:
        latest = parse_step_dir(read_latest(root) or "")
    except CheckpointError:
        latest = None
    if latest is None:
        return steps
    return [s for s in steps if s > latest] + [s for s in steps if s <= latest]


def read_latest(root: Path) -> Optional[str]:
    """The step folder `latest` names (None when there is no `latest`).

    `latest` must be a plain file of one line naming a step folder of this root (`step_NNNNNNNN`, no
    path): anything else (a symlink, a folder, bytes that are not UTF-8, `../other/step_..`) is refused
    with a one-line error rather than followed.
    """
    f = root / LATEST
    if not os.path.lexists(f):
        return None
    what = f"{f}: expected a plain file holding one line that names a step folder of this checkpoint"
    if f.is_symlink() or not f.is_file():
        raise CheckpointError(f"{what}, found a {'symlink' if f.is_symlink() else 'folder or special file'}")
    try:
        with open(f, "rb") as fh:
            name = fh.read(4096).decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{what}, found bytes that are not UTF-8 text") from None
    if parse_step_dir(name) is None:
        raise CheckpointError(f"{what} (step_NNNNNNNN), found {name[:80]!r}")
    return name


def write_latest(root: Path, name: str) -> None:
    """Replace `latest` atomically: write a temp file (created afresh, never through a symlink), fsync it,
    os.replace, fsync the folder. On failure the temp file is removed and `latest` is untouched."""
    if parse_step_dir(name) is None:
        raise ValueError(f"write_latest: {name!r} is not a step folder name")
    tmp = root / LATEST_TMP
    write_new_file(tmp, (name + "\n").encode())
    try:
        os.replace(tmp, root / LATEST)
    except BaseException:
        unlink_quietly(tmp)
        raise
    fsync_dir(root)


def write_new_file(path: Path, data: bytes) -> None:
    """Create `path` as a new plain file holding `data`, fsynced. Whatever was at `path` (a stale temp file,
    a symlink planted there) is unlinked first, never followed: O_CREAT | O_EXCL | O_NOFOLLOW. On failure
    nothing is left at `path`."""
    unlink_quietly(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        unlink_quietly(path)
        raise
    os.close(fd)


def unlink_quietly(path: Path) -> None:
    """Remove a file or a symlink (never what it points to); nothing there is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_tree(path: Path) -> None:
    """Remove a folder this project created; a symlink is unlinked, never followed."""
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        unlink_quietly(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_step_dir(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def resolve(path: str | os.PathLike) -> Path:
    """A step folder, or a checkpoint root meaning the step that `latest` names."""
    p = Path(path)
    if is_step_dir(p):
        return p
    if not p.exists():
        raise CheckpointError(f"checkpoint '{p}' does not exist")
    if not p.is_dir():
        raise CheckpointError(f"'{p}' is not a checkpoint: expected a step folder or a checkpoint root folder")
    name = read_latest(p)
    if name is None:
        raise CheckpointError(f"'{p}' is not a checkpoint: no {MANIFEST} and no '{LATEST}' file")
    target = p / name
    if target.is_symlink():
        raise CheckpointError(f"{p / LATEST} names '{name}', which is a symlink (a step folder of this root "
                              f"must be a real folder)")
    if not is_step_dir(target):
        raise CheckpointError(f"{p / LATEST} names '{name}', which is missing or has no {MANIFEST}")
    return target


@dataclass(frozen=True)
class WriteItem:
    """One slice a coordinate writes: which tensor, which part of it, into which file under which key."""
    name: str  # global parameter name
    kind: str  # "model" | "exp_avg" | "exp_avg_sq"
    file: str  # MODEL_FILE or OPTIM_FILE
    box: Box  # the region of the global tensor
    flat: Optional[tuple] = None  # a piece: elements [a, b) of the box, row-major (None: the whole box)

    @property
    def key(self) -> str:
        return self.name if self.kind == "model" else f"{self.name}.{self.kind}"


def replicated_writer(tensors: Iterable[tuple[str, Partition]], tp: int) -> dict[str, int]:
    """The tp rank that writes each tp-replicated tensor of a stage (identical on every tp rank): the i-th
    by global name goes to tp rank i mod tp, so these small tensors spread over the tp ranks."""
    names = sorted(n for n, p in tensors if p.dim is None and not p.tied_to)
    return {n: i % tp for i, n in enumerate(names)}


def plan_writes(tensors: Iterable[tuple[str, Partition]], coord: Coord, layout: Layout,
                optimizer: bool = True) -> list[WriteItem]:
    """Everything the coordinate `coord` writes, given the (name, partition) of the tensors its pipeline
    stage holds. Live saves, `split` and `reshard` all ask this one function, so they agree on the tree.

    The stage's tp slice is cut over dp as the ZeRO-1 optimizer cuts it (`parallel.data.dp_pieces`: one
    flat space of the tensors sorted by name, dp equal contiguous ranges): dp rank d writes range d, i.e.
    the weights and both moments of the piece of each tensor that range overlaps (`flat`, or the whole box
    when the range covers the tensor). So every dp rank of a stage writes the same bytes (± one element
    per range), with or without ZeRO-1, and a ZeRO-1 rank writes its moments exactly as it holds them.
    A tp-replicated tensor is written by one tp rank (`replicated_writer`); tied copies are never written
    (they load from their source).
    """
    tensors = sorted(tensors)
    boxes = {n: tp_box(p, coord.tp, layout.tp) for n, p in tensors}
    pieces = dp_pieces([(n, boxes[n].numel, bool(p.tied_to)) for n, p in tensors], coord.dp, layout.dp)
    writer = replicated_writer(tensors, layout.tp)
    items = []
    for name, part in tensors:
        a, b = pieces[name]
        if part.tied_to or a == b or writer.get(name, coord.tp) != coord.tp:
            continue
        box = boxes[name]
        flat = None if (a, b) == (0, box.numel) else (a, b)
        items.append(WriteItem(name, "model", MODEL_FILE, box, flat))
        if optimizer:
            items += [WriteItem(name, kind, OPTIM_FILE, box, flat) for kind in ("exp_avg", "exp_avg_sq")]
    return items
