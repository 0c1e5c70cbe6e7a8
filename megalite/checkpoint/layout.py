"""The rank-coded checkpoint tree, and nothing else: names, paths, the `latest` pointer, who writes what.

    <root>/
      latest                        one line: the name of the newest committed step folder
      step_00000200/
        manifest.json               the whole picture (manifest.py)
        tp00-pp00-dp00/             written only by the rank at that coordinate
          model.safetensors         its share of the (tp, pp) model slice
          optimizer.safetensors     its share of the optimizer state (its ZeRO-1 piece with zero1)
          state.json                RNG states, sampler position, step
      .tmp-step_00000200/           a save in progress (renamed into place on commit)

Every function here has its inverse next to it, and both are unit-tested.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from ..parallel.grid import Coord, Layout
from ..parallel.data import zero1_piece
from ..parallel.tensor import Partition, tp_box

MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
LATEST = "latest"
LOCK = "lock"
TMP_PREFIX = ".tmp-"

_COORD_RE = re.compile(r"^tp(\d{2,})-pp(\d{2,})-dp(\d{2,})$")
_STEP_RE = re.compile(r"^step_(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint problem: the message is one line naming the file or field and what was expected."""


class Box(tuple):
    """A region of a global tensor, ((start, end) per dim), half-open: the one home of slice arithmetic.

    A tuple, so it is hashable, compares by value and serialises as [[start, end], ...]."""

    def __new__(cls, ranges):
        return super().__new__(cls, tuple((int(a), int(b)) for a, b in ranges))

    @classmethod
    def whole(cls, shape) -> "Box":
        return cls((0, n) for n in shape)

    @property
    def shape(self) -> tuple:
        return tuple(b - a for a, b in self)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def intersect(self, other) -> Optional["Box"]:
        """The common region, or None when it is empty."""
        out = Box((max(a, c), min(b, d)) for (a, b), (c, d) in zip(self, other))
        return out if all(a < b for a, b in out) else None

    def within(self, outer: "Box") -> tuple:
        """This box as an index (slices) into a tensor holding `outer`."""
        return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(self, outer))

    @property
    def index(self) -> tuple:
        """This box as an index (slices) into the global tensor."""
        return tuple(slice(a, b) for a, b in self)

    def to_json(self) -> list:
        return [[a, b] for a, b in self]


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
    """Steps with a committed folder under root (a manifest present), oldest first.

    Oldest means: steps above the one `latest` names come first (a run that rolled back with
    resume=PATH abandoned them), then the rest in step order. So keep_last prunes an abandoned run's
    checkpoints before this run's, and resume=auto's fallback prefers this run's.
    """
    if not root.is_dir():
        return []
    steps = sorted(s for s in (parse_step_dir(p.name) for p in root.iterdir() if (p / MANIFEST).is_file())
                   if s is not None)
    latest = parse_step_dir(read_latest(root) or "")
    if latest is None:
        return steps
    return [s for s in steps if s > latest] + [s for s in steps if s <= latest]


def read_latest(root: Path) -> Optional[str]:
    f = root / LATEST
    if not f.exists():
        return None
    return f.read_text().strip()


def write_latest(root: Path, name: str) -> None:
    """Replace `latest` atomically: write a temp file, fsync it, os.replace, fsync the folder."""
    tmp = root / f".{LATEST}.tmp"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fsync_dir(root)


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
    name = read_latest(p)
    if name is None:
        raise CheckpointError(f"'{p}' is not a checkpoint: no {MANIFEST} and no '{LATEST}' file")
    target = p / name
    if not is_step_dir(target):
        raise CheckpointError(f"{p / LATEST} names '{name}', which is missing or has no {MANIFEST}")
    return target


def assign_writers(tensors: Iterable[tuple[str, int, bool]], tp: int, dp: int) -> dict[str, tuple]:
    """Who writes each tensor of one pipeline stage, so that no copy is written twice and every rank
    writes a similar number of bytes.

    `tensors` are (name, numel, replicated_over_tp). A tp-split tensor is written by every tp rank (its own
    slice) at one chosen dp index: owner (None, d). A tp-replicated tensor is identical on all tp*dp ranks
    of the stage and is written once, by owner (t, d). Greedy, largest first, ties by name: a pure
    function of its inputs, so every rank computes the same answer without talking.
    """
    load = [[0] * dp for _ in range(tp)]
    out = {}
    for name, size, replicated in sorted(tensors, key=lambda x: (-x[1], x[0])):
        if replicated:
            t, d = min(((t, d) for t in range(tp) for d in range(dp)), key=lambda td: (load[td[0]][td[1]], td))
            load[t][d] += size
            out[name] = (t, d)
        else:
            d = min(range(dp), key=lambda d: (sum(load[t][d] for t in range(tp)), d))
            for t in range(tp):
                load[t][d] += size // tp
            out[name] = (None, d)
    return out


@dataclass(frozen=True)
class WriteItem:
    """One slice a coordinate writes: which tensor, which part of it, into which file under which key."""
    name: str  # global parameter name
    kind: str  # "model" | "exp_avg" | "exp_avg_sq"
    file: str  # MODEL_FILE or OPTIM_FILE
    box: Box  # the region of the global tensor
    flat: Optional[tuple] = None  # ZeRO-1: elements [a, b) of the box, row-major

    @property
    def key(self) -> str:
        return self.name if self.kind == "model" else f"{self.name}.{self.kind}"


def plan_writes(tensors: Iterable[tuple[str, Partition]], coord: Coord, layout: Layout, zero1: bool,
                optimizer: bool = True) -> list[WriteItem]:
    """Everything the coordinate `coord` writes, given the (name, partition) of the tensors its pipeline
    stage holds. Live saves, `split` and `reshard` all ask this one function, so they agree on the tree.

    Tied copies are never written (they load from their source). Without zero1 a moment follows its
    parameter's writer; with zero1 every dp rank writes its own piece of each moment.
    """
    own = [(n, p) for n, p in tensors if not p.tied_to]
    owner = assign_writers([(n, math.prod(p.global_shape), p.dim is None) for n, p in own], layout.tp, layout.dp)
    items = []
    for name, part in own:
        box = Box(tp_box(part, coord.tp, layout.tp))
        t_owner, d_owner = owner[name]
        if t_owner is not None and t_owner != coord.tp:
            continue  # tp-replicated: another tp rank of this stage writes it
        if d_owner == coord.dp:
            items.append(WriteItem(name, "model", MODEL_FILE, box))
        if not optimizer:
            continue
        if zero1:
            a, b = zero1_piece(box.numel, coord.dp, layout.dp)
            flat = (a, b) if b > a else None
            if flat is None:
                continue
        elif d_owner != coord.dp:
            continue
        else:
            flat = None
        for kind in ("exp_avg", "exp_avg_sq"):
            items.append(WriteItem(name, kind, OPTIM_FILE, box, flat))
    return items
