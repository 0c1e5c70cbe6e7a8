"""Fault-injection hooks: environment-driven no-ops in production paths, for tests to trigger.

This module imports nothing of megalite's (the harness that uses it is `benchmarks/stress.py`).

The training loop calls one hook, `step_end(step, rank)`, after each step; it runs the two step hooks:

`maybe_crash` lets a test make one rank die hard at a chosen step (to exercise `torchrun --max-restarts`):
    MEGALITE_CRASH_AT_STEP=5 MEGALITE_CRASH_RANK=1 MEGALITE_CRASH_ONCE=/tmp/marker
The marker file makes it happen once, so the restarted workers run through.

`slow_step` makes every step from a chosen one on take S seconds longer (a sleep at its end, on every rank,
before the loop looks for a stop signal), so that a test can land a stop signal in the middle of a step
slower than the launcher's grace period:
    MEGALITE_SLOW_STEP_S=3 MEGALITE_SLOW_FROM_STEP=3

`kill_point` makes a process die hard (SIGKILL, no cleanup of any kind) at a named boundary of the
checkpoint commit protocol, deterministically:
    MEGALITE_KILL_POINT=manifest_synced MEGALITE_KILL_RANK=0 MEGALITE_KILL_NTH=2
kills rank 0 the second time it reaches that point. The points, in protocol order (checkpoint/commit.py):
KILL_POINTS.

`no_rename_exchange` makes a re-save act as if the file system had no RENAME_EXCHANGE, so that tests reach
the two-rename fallback (and its kill point `resave_old_moved`):
    MEGALITE_NO_RENAME_EXCHANGE=1
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


KILL_POINTS = (
    "slices_written",    # a rank has written and fsynced its coordinate folder (before rank 0 hears of it)
    "manifest_written",  # rank 0 has written manifest.json into .tmp-step_N
    "manifest_synced",   # ... and fsynced the folder: the temporary step is complete
    "resave_swapped",    # re-save: the new step_N swapped in atomically, the old copy not yet removed
    "resave_old_moved",  # re-save without RENAME_EXCHANGE: the old step_N moved aside, the new not yet in
    "renamed",           # .tmp-step_N is step_N (fsynced), `latest` still names the previous step
    "latest_written",    # `latest` names step_N, pruning not yet done
    "pruning",           # the first old step of this prune has been deleted
)
_reached: dict = {}


def kill_point(name: str) -> None:
    """SIGKILL this process here if MEGALITE_KILL_POINT names this point (see the module docstring)."""
    want = os.environ.get("MEGALITE_KILL_POINT")
    if want != name:
        return
    if int(os.environ.get("RANK", "0")) != int(os.environ.get("MEGALITE_KILL_RANK", "0")):
        return
    _reached[name] = _reached.get(name, 0) + 1
    if _reached[name] == int(os.environ.get("MEGALITE_KILL_NTH", "1")):
        os.kill(os.getpid(), signal.SIGKILL)


def step_end(step: int, rank: int) -> None:
    """The training loop's one hook, after step `step` (1-based) on global rank `rank`: a slow step, then a
    crash, each only when its environment variables ask for it."""
    slow_step(step)
    maybe_crash(step, rank)


def maybe_crash(step: int, rank: int) -> None:
    at = os.environ.get("MEGALITE_CRASH_AT_STEP")
    if not at or int(at) != step or int(os.environ.get("MEGALITE_CRASH_RANK", "0")) != rank:
        return
    marker = os.environ.get("MEGALITE_CRASH_ONCE")
    if marker:
        if os.path.exists(marker):
            return
        Path(marker).write_text(f"crashed at step {step} on rank {rank}\n")
    print(f"megalite: injected crash at step {step} on rank {rank}", file=sys.stderr, flush=True)
    os._exit(13)


def slow_step(step: int) -> None:
    """Sleep MEGALITE_SLOW_STEP_S seconds in step `step` (1-based) if it is >= MEGALITE_SLOW_FROM_STEP (default 1).
    A signal during the sleep runs its handler and the sleep goes on (PEP 475), as a long step would."""
    seconds = float(os.environ.get("MEGALITE_SLOW_STEP_S", "0") or 0)
    if seconds > 0 and step >= int(os.environ.get("MEGALITE_SLOW_FROM_STEP", "1")):
        time.sleep(seconds)


def no_rename_exchange() -> bool:
    """Whether to act as if renameat2(RENAME_EXCHANGE) were unavailable (MEGALITE_NO_RENAME_EXCHANGE set)."""
    return bool(os.environ.get("MEGALITE_NO_RENAME_EXCHANGE"))
