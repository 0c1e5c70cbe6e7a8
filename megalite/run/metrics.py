"""`<out_dir>/metrics.jsonl`: one JSON record per step, appended and never truncated.

A launch that resumes appends an event line `{"event": "resume", "step": N, "layout": ..., "from": ...}` and
then its steps; a step that an interrupted launch logged after its last checkpoint is logged again by the
launch that redoes it, and readers keep the *last* record of each step. A fresh start never overwrites an
earlier run's file: it moves it aside to `metrics.<time>.jsonl` first.

The file is appended only as a regular file of the run folder (base/fs.open_append): a symlink, a
FIFO or a device there is refused before the first step, and a file shared by hard links with another run's
(`cp -al`) becomes this run's own copy first, so no run ever writes into another's record.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..base.errors import MetricsError
from ..base.fs import move_aside, open_append, read_all, regular_or_absent
from ..base.jsonio import loads

NAME = "metrics.jsonl"


def check_path(out_dir: Path):
    """The lstat of <out_dir>/metrics.jsonl (None if there is none yet); an UnsafeFileError if it is not a
    regular file (a symlink, a FIFO, a folder). Start-up calls it before anything is written."""
    return regular_or_absent(Path(out_dir) / NAME, "train.out_dir")


def open_for_run(out_dir: Path, resumed_step: int, event: dict | None = None, log=print):
    """The file handle this launch appends its records to (rank 0 only)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / NAME
    st = check_path(out_dir)  # before anything moves: a refused file leaves everything as it was
    if not resumed_step and st is not None and st.st_size:
        aside = move_aside(path)
        log(f"megalite: fresh start: moved the previous {path} aside to {aside.name}")
    f = open_append(path, log)
    if resumed_step:
        f.write(json.dumps({"event": "resume", "step": resumed_step, **(event or {})}) + "\n")
        f.flush()
    return f


def _lines(run_dir) -> list[dict]:
    path = Path(run_dir) / NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (expected a run's out_dir)")
    rows = []
    for i, line in enumerate(read_all(path, follow=True).decode("utf-8", errors="replace").splitlines(), 1):
        if line.strip():
            try:
                row = loads(line, f"{path} line {i}", MetricsError)
            except MetricsError:
                raise MetricsError(f"{path} line {i} is not JSON (or is nested too deep)") from None
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise MetricsError(f"{path} line {i}: expected an object with an integer 'step'")
            rows.append(row)
    return rows


def read(run_dir) -> list[dict]:
    """The step records in step order, the last one logged for each step (redone steps replace earlier ones)."""
    last = {r["step"]: r for r in _lines(run_dir) if "event" not in r}
    return [last[s] for s in sorted(last)]


def events(run_dir) -> list[dict]:
    """The resume events, in order (each names the step it resumed from, and the layout)."""
    return [r for r in _lines(run_dir) if "event" in r]
