"""The rank-coded checkpoint tree: names, paths, step folders, the `latest` pointer, and pruning old steps.

    <root>/
      latest                        one line: the name of the newest committed step folder
      step_00000200/
        manifest.json               the whole picture (manifest.py)
        tp00-pp00-dp00/             written only by the rank at that coordinate (tp00-cp01-pp00-dp00 with cp > 1)
          model.safetensors         its share of the (tp, pp) model slice (range dp*cp+cp of its flat space)
          optimizer.safetensors     its share of the optimizer state (the same share of its AdamW moments)
          state.json                RNG states, sampler position, step
          tokenizer.json            the run's tokenizer (coordinate 0's folder only: rank 0 writes it)
          origin.json               its source's tokenizer files, dtype and ids, if any (beside it)
      .tmp-step_00000200/           a save in progress (renamed into place on commit)

Every name or path function here has its inverse next to it, and both are unit-tested; `publish` (`latest`,
then `prune`) ends a commit. Who writes what is plan.py's.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Iterable, Optional

from ..base.errors import CheckpointError
from ..base.faults import kill_point
from ..base.fs import kind_of, read_all, remove_tree, replace_atomically
from ..parallel.grid import Coord

MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
TOKENIZER_FILE = "tokenizer.json"  # in coordinate 0's folder only (see tokenizer_rel)
ORIGIN_FILE = "origin.json"  # beside it: what the model's source said that its tensors do not (base/origin.py)
LATEST = "latest"
LATEST_TMP = ".latest.tmp"
LOCK = "lock"
TMP_PREFIX = ".tmp-"

_COORD_RE = re.compile(r"^tp(\d{2,})(?:-cp(\d{2,}))?-pp(\d{2,})-dp(\d{2,})$")
COORD_PATTERN = r"tp\d{2,}(?:-cp\d{2,})?-pp\d{2,}-dp\d{2,}"  # for the manifest's file names
_STEP_RE = re.compile(r"^step_(\d{8,})$")


def coord_dir(c: Coord, cp: int = 1) -> str:
    """The folder of coordinate c in a layout with context-parallel size `cp`: the cp field is in the name only
    when cp > 1, so a cp = 1 tree is exactly what megalite wrote before cp existed."""
    if cp > 1:
        return f"tp{c.tp:02d}-cp{c.cp:02d}-pp{c.pp:02d}-dp{c.dp:02d}"
    return f"tp{c.tp:02d}-pp{c.pp:02d}-dp{c.dp:02d}"


def tokenizer_rel(cp: int = 1) -> str:
    """Where a step keeps the run's tokenizer: coordinate 0's folder (rank 0 writes it; every layout has it)."""
    return f"{coord_dir(Coord(0, 0, 0), cp)}/{TOKENIZER_FILE}"


def origin_rel(cp: int = 1) -> str:
    """Where a step keeps its model's origin (base/origin.py): beside the tokenizer, in coordinate 0's folder."""
    return f"{coord_dir(Coord(0, 0, 0), cp)}/{ORIGIN_FILE}"


def parse_coord_dir(name: str) -> Coord:
    m = _COORD_RE.match(name)
    if not m:
        raise ValueError(f"'{name}' is not a coordinate folder (expected tpNN-ppNN-dpNN or tpNN-cpNN-ppNN-dpNN)")
    return Coord(int(m[1]), int(m[3]), int(m[4]), int(m[2] or 0))


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
        name = read_all(f, 4096).decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{what}, found bytes that are not UTF-8 text") from None
    if parse_step_dir(name) is None:
        raise CheckpointError(f"{what} (step_NNNNNNNN), found {name[:80]!r}")
    return name


def write_latest(root: Path, name: str) -> None:
    """Replace `latest` atomically through `.latest.tmp` (created afresh, never through a symlink: see
    files.replace_atomically). On failure the temp file is removed and `latest` is untouched."""
    if parse_step_dir(name) is None:
        raise ValueError(f"write_latest: {name!r} is not a step folder name")
    replace_atomically(root / LATEST, (name + "\n").encode(), tmp=root / LATEST_TMP)


def latest_or_nothing(root: Path) -> str:
    """What `latest` names, for an error that says what is left: the name, "nothing" or "something unreadable"."""
    try:
        return read_latest(root) or "nothing"
    except CheckpointError:
        return "something unreadable"


def publish(root: Path, step: int, keep_last: int = 0, keep: Iterable[int] = ()) -> list[int]:
    """The last act of a commit, once step_N is in place: `latest` names it (write_latest; an OSError there
    leaves `latest` as it was), then the steps beyond keep_last are pruned (see prune); returns those deleted."""
    write_latest(root, step_dir(step))
    kill_point("latest_written")
    return prune(root, keep_last, step, keep)


def prune(root: Path, keep_last: int, saved: Optional[int] = None, keep: Iterable[int] = ()) -> list[int]:
    """Delete the oldest committed steps beyond keep_last, counting only steps up to `saved` (the step just
    committed). Never deleted: the step `latest` names, any step newer than `saved` (another history's, e.g.
    abandoned by a rollback), and the steps in `keep` (the manager's: steps newer than the one the run
    resumed from that it did not write, and steps that failed verification)."""
    if keep_last <= 0:
        return []
    latest = read_latest(root)
    if saved is None:  # the API without a step: count up to the step `latest` names
        saved = parse_step_dir(latest or "")
    keep = set(keep)
    try:
        steps = sorted(s for s in committed_steps(root) if saved is None or s <= saved)
    except OSError as e:  # the save stands; only its pruning is skipped
        print(f"WARNING: checkpoint.keep_last: could not list {root} ({e.strerror or e}); nothing pruned",
              file=sys.stderr, flush=True)
        return []
    doomed = [s for s in steps[:-keep_last] if step_dir(s) != latest and s not in keep]
    deleted = []
    for i, s in enumerate(doomed):
        try:
            remove_tree(root / step_dir(s))
        except OSError as e:  # reported, never counted as deleted; the save itself stands
            print(f"WARNING: checkpoint.keep_last: could not delete {root / step_dir(s)} "
                  f"({e.strerror or e}); it is left in place", file=sys.stderr, flush=True)
            continue
        deleted.append(s)
        if i == 0:
            kill_point("pruning")
    return deleted


def is_step_dir(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def resolve(path: str | os.PathLike) -> Path:
    """A step folder, or a checkpoint root meaning the step that `latest` names."""
    p = Path(path)
    if is_step_dir(p):
        return p
    if os.path.lexists(p / MANIFEST) and not (p / MANIFEST).is_symlink():  # a FIFO, a folder: named, never read
        raise CheckpointError(f"{p / MANIFEST}: the manifest is {kind_of(os.lstat(p / MANIFEST))}, expected a "
                              f"regular file")
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
