"""Rank agreement: every helper that makes all ranks decide alike, in one place.

    everyone(obj, grid, axis)            every rank's `obj`, in rank order (all_gather_object; a world of one: [obj])
                                         (no grid: over the job's default group)
    gather_to_first(obj, axis)           every member's `obj` on the axis' first rank, None elsewhere (gather_object)
    bcast_object(obj, grid, group)       rank 0's `obj` on every rank (broadcast_object_list)
    agreed(problem, grid, what, error)   a problem found on any rank raised alike on every rank
    agree(fn, grid)                      run a phase on every rank; a user error on any rank stops them all
    agree_settings(settings, error)      start-up: every rank runs the same settings, or every rank stops

All of them travel on gloo groups (host-side Python objects): the grid's `cpu` group unless told otherwise. A
MegaliteError raised alike on every rank is marked `shared` (errors.everywhere), so the CLI prints it once.
"""
from __future__ import annotations

import hashlib
import json
from typing import Optional

import torch.distributed as dist

from ..base.errors import USER_ERRORS, CheckpointError, MegaliteError, StartupError, one_line
from .grid import Axis, ParallelGrid


def everyone(obj, grid: Optional[ParallelGrid] = None, axis: Optional[Axis] = None) -> list:
    """Every rank's `obj` in rank order: over the whole grid on its gloo `cpu` group, or over one `axis` (its
    members in axis order), or with no grid over the job's default group (a worker with no grid of its own, as
    the bench's are). One all_gather_object; no collective when there is one rank."""
    if axis is not None:
        size, group = axis.size, axis.group
    elif grid is not None:
        size, group = grid.layout.world_size, grid.cpu
    else:
        size, group = (dist.get_world_size() if dist.is_initialized() else 1), None
    if size == 1:
        return [obj]
    out = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_to_first(obj, axis: Axis) -> Optional[list]:
    """Every member's `obj` on the axis' first rank (None on the others). One gather_object."""
    if not axis.active:
        return [obj]
    out = [None] * axis.size if axis.rank == 0 else None
    dist.gather_object(obj, out, group=axis.group, group_dst=0)
    return out


def bcast_object(obj, grid: ParallelGrid, group):
    """Rank 0's `obj` on every rank, on `group` (a gloo group over every rank). One broadcast_object_list."""
    if grid.layout.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def agreed(problem: Optional[str], grid: ParallelGrid, what: str, error: type = CheckpointError) -> None:
    """Raise on every rank if any rank found a problem (one all_gather_object over the grid's gloo group):
    the lowest failing rank's one line, the same `error` everywhere, before anything is written."""
    found = everyone(problem, grid)
    for r, p in enumerate(found):
        if p is not None:
            raise error(f"{what}: rank {r}: {p}" if len(found) > 1 else f"{what}: {p}", shared=True)


def agree(fn, grid: ParallelGrid):
    """Run fn() on every rank; if a user error happens on any rank, every rank raises the lowest failing
    rank's error (marked shared, so only rank 0 prints it), instead of ranks dying one by one
    in different places. Anything else (a bug) keeps its own traceback.

    One all_gather_object over the grid's gloo group (`grid.cpu`) of each rank's (error type, message) or None.
    """
    result, err = None, None
    try:
        result = fn()
    except USER_ERRORS as e:
        err = e
    msgs = everyone(None if err is None else (type(err).__name__, str(err)), grid)
    first = next((m for m in msgs if m is not None), None)
    if first is not None and err is None:
        err = StartupError(first[1])
    if err is not None:
        if isinstance(err, MegaliteError):
            err.everywhere()
        else:  # an OSError: say that every rank raises it
            err = StartupError(one_line(err))
        raise err
    return result


def agree_settings(settings: Optional[dict], error: Optional[BaseException] = None) -> None:
    """Start-up, on the default group (before the grid: a layout that differs between ranks would build
    different groups and hang): every rank must hold the same `settings` ({name: value as text}: the resolved
    config, the paths as each rank resolves them, the token file's identity). `settings` None: this rank's
    config did not even load (`error` says why; its config file is not the others'): every rank raises that
    error, naming the rank. Else any difference raises the same StartupError on every rank, one line naming the
    first field that differs and which ranks hold which value (every field that differs is counted). Then a
    user error of one rank's (`error`: its config failed validation) is raised by every rank. A world of one
    just raises its error.

    Cost: one all_gather_object of a digest per rank; the settings themselves travel only when they differ."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        digest = None if settings is None else hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
        mine = (digest, None if error is None else one_line(error))
        got = [None] * world
        dist.all_gather_object(got, mine)
        unloaded = next((r for r, (d, _) in enumerate(got) if d is None), None)
        if unloaded is not None and settings is not None:
            raise StartupError(f"rank {unloaded}: {got[unloaded][1]}")
        if settings is not None and len({d for d, _ in got}) > 1:
            tables = [None] * world
            dist.all_gather_object(tables, settings)
            raise StartupError(disagreement(tables))
        failed = next((r for r, (_, e) in enumerate(got) if e is not None), None)
        if error is None and failed is not None:
            raise StartupError(f"rank {failed}: {got[failed][1]}")
    if error is not None:
        raise error.everywhere() if isinstance(error, MegaliteError) else StartupError(one_line(error))


def disagreement(tables: list) -> str:
    """One line: the first field whose value differs between ranks' `tables` (rank order), who holds what, and
    how many other fields differ."""
    keys = list(dict.fromkeys(k for t in tables for k in t))
    differ = [k for k in keys if len({t.get(k) for t in tables}) > 1]
    first = differ[0]
    holders: dict = {}
    for rank, t in enumerate(tables):
        holders.setdefault(t.get(first, "(not set)"), []).append(rank)
    who = "; ".join(f"{_ranks(rs)} {'has' if len(rs) == 1 else 'have'} {_short(v)}" for v, rs in holders.items())
    more = f" (and {len(differ) - 1} more: {', '.join(differ[1:4])}{', ...' if len(differ) > 4 else ''})" \
        if len(differ) > 1 else ""
    return (f"ranks disagree on {first}: {who}{more}; every rank must run the same config, paths and token "
            f"file (a config file, an override or a working directory that differs between hosts?)")


def _ranks(rs: list) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2,5'; [3] -> 'rank 3'."""
    runs: list = []
    for r in rs:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)
    return f"{'rank' if len(rs) == 1 else 'ranks'} {text}"


def _short(v) -> str:
    """A value for the one line: at most 160 characters, elided in the middle (paths differ at the end)."""
    v = str(v)
    return v if len(v) <= 160 else v[:60] + "..." + v[-97:]
