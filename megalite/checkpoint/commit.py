"""The commit protocol: every rank's folder written, gathered, committed atomically; and its repair.

Commit protocol (all coordination on the commit's own gloo groups, `CommitGroups`, never shared with training):
  1. rank 0 finishes or undoes what a killed save left (`recover`) and creates `.tmp-step_N/`;
  2. every rank writes its own `tpXX-ppXX-dpXX/` folder (safetensors + JSON), fsyncs, and reports the
     files with sizes and checksums (or its error) to rank 0, through its stage's leader (`_gather`)
     (`write_rank`: its safetensors streamed with their checksums, its state.json and any other small file of
     its payload, fsynced; the same function writes every coordinate's folder in `split` and `reshard`);
  3. rank 0, if all succeeded, runs `commit_step` (the one commit, shared with `split`/`reshard`): the
     manifest (manifest.write: built from the reports, parsed back, every reported file found at its reported
     size, nothing re-read; then written), fsyncs, moves `.tmp-step_N` -> `step_N` (a re-saved step is swapped
     in atomically), and only then replaces `latest` and prunes (tree.publish). On any failure before the
     rename it removes the temporary folder;
  4. rank 0 broadcasts the outcome, and every rank returns or raises the same CheckpointError.

At every instant `latest` names a committed folder that verifies: a process killed at any point of the
protocol leaves at worst a `.tmp-*` folder that the next start finishes or removes (`recover`). The kill
points of megalite.base.faults (`kill_point`) sit at each boundary, and tests kill a rank at each in turn.

An async save (async_save.AsyncSaver) runs steps 1-4 in a background thread. Before a re-saved step is moved
in by `recover`, it is verified (verify.complete), as every loader would check it.
"""
from __future__ import annotations

import ctypes
import errno
import os
import sys
import traceback
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import torch.distributed as dist

from ..base.errors import CheckpointError
from ..base.faults import kill_point, no_rename_exchange
from ..base.fs import fsync_dir, remove_tree, unlink_quietly, write_new
from ..parallel.agree import bcast_object, gather_to_first
from ..parallel.grid import Axis
from .verify import complete
from .manifest import FileRecord, RankReport, SliceRef, StepMeta, checksum_block, write
from .plan import Payload
from .stream import StreamingWriter, crc32c
from .tree import (LATEST, LATEST_TMP, STATE_FILE, TMP_PREFIX, coord_dir, latest_or_nothing, parse_step_dir, publish,
                   step_dir, tmp_dir)


# ---------------------------------------------------------------- the commit's own groups
@dataclass
class CommitGroups:
    """The gloo groups only the commit uses, never shared with training (a background commit's collectives
    must not interleave with the loop's): one over every rank, one per pipeline stage (its ranks report to the
    stage's leader) and one over the stage leaders. Made on a grid's first save, by every rank in the main
    thread (new_group is collective), and kept for the grid's life."""
    every: object
    stage: Axis
    leaders: Axis


_GROUPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def commit_groups(grid) -> CommitGroups:
    """The grid's CommitGroups, made on first use (all ranks call it at the same save)."""
    if grid in _GROUPS:
        return _GROUPS[grid]
    layout, one = grid.layout, Axis(1, 0)
    if layout.world_size == 1:
        groups = CommitGroups(None, one, one)
    else:
        timeout, rank = getattr(grid, "timeout", None), grid.rank
        every = dist.new_group(backend="gloo", timeout=timeout)
        axes = {"stage": one, "leaders": one}
        for name, sets in [("stage", [layout.stage_ranks(layout.coord_of(r)) for r in layout.leader_ranks()]),
                           ("leaders", [layout.leader_ranks()])]:
            for members in sets:
                if len(members) > 1:
                    group = dist.new_group(members, backend="gloo", timeout=timeout)
                    if rank in members:
                        axes[name] = Axis(len(members), members.index(rank), group)
        groups = CommitGroups(every, **axes)
    _GROUPS[grid] = groups
    return groups


def _gather(report: RankReport, grid) -> Optional[list]:
    """Every rank's report on rank 0, in two levels so that no rank receives a message per rank: the
    ranks of each pipeline stage send theirs to the stage's leader (its first rank), which merges them;
    rank 0 (the leader of stage 0) then gathers the pp merged parts. Rank 0 receives tp*dp - 1 + pp - 1
    messages instead of world - 1, and the stages gather in parallel. None on every other rank."""
    groups = commit_groups(grid)
    part = gather_to_first(report, groups.stage)
    if part is None:
        return None
    merged = RankReport.merged(part)
    return gather_to_first(merged, groups.leaders)


# ---------------------------------------------------------------- step 2: one coordinate's folder
def write_rank(folder: Path, pay: Payload, rel: str, direct: bool = False) -> RankReport:
    """Write one coordinate's folder; return its report for the manifest (see manifest.build). With `direct`,
    its safetensors files go around the page cache (O_DIRECT, see stream.StreamingWriter): the same bytes."""
    block = checksum_block()
    folder.mkdir(parents=True, exist_ok=True)
    report = RankReport()
    crcs = {}
    for fname, tensors in pay.files.items():
        size, crc, crcs[fname] = _write_tensors(folder / fname, tensors, block, direct)
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


def _write_tensors(path: Path, tensors: dict, block: int, direct: bool = False) -> tuple[int, str, dict]:
    """Stream one safetensors file (keys sorted: the same state gives the same bytes); return its size,
    its header's CRC32C and each tensor's block CRC32Cs, computed on the buffers as they are written."""
    keys = sorted(tensors)
    w = StreamingWriter(path, [(k, list(tensors[k].shape), tensors[k].dtype) for k in keys], {"format": "pt"},
                        block=block, direct=direct)
    try:
        crcs = {k: tuple(w.write(k, tensors[k])) for k in keys}
        w.close()
    except BaseException:
        w.abort()
        raise
    return w.size, f"{w.header_crc32c:08x}", crcs


# ---------------------------------------------------------------- steps 3-4: the commit and its repair
OLD_PREFIX = TMP_PREFIX + "old-"  # a step being replaced, kept until its replacement is in place


def _exchange(a: Path, b: Path) -> bool:
    """Swap two folders in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    if no_rename_exchange():  # a test hook (faults.py): exercise the two-rename fallback
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))


_RECOVERED: set = set()  # the roots (real paths) this process has put right since its last failed save


def recover_once(root: Path) -> list[str]:
    """`recover(root)` the first time this process saves into (or starts a run on) `root`, and again after a
    save there failed; not in every save: between two good saves of this process nothing is left to repair."""
    return [] if os.path.realpath(root) in _RECOVERED else recover(root)


def recover(root: Path) -> list[str]:
    """What a killed save left behind, put right (rank 0 only, holding the run's lock); returns what it did.

    A step being re-saved whose old copy was moved aside (`.tmp-old-step_N`) but whose new copy was not
    yet moved in: the new copy is moved in if it is complete (it verifies), else the old one is put back.
    Every other temporary folder (`.tmp-step_N`, a save that never committed) and a stale `.latest.tmp`
    are removed. Symlinks are unlinked, never followed.
    """
    done = []
    if not root.is_dir():
        return done
    for old in sorted(root.glob(OLD_PREFIX + "*")):
        name = old.name[len(OLD_PREFIX):]
        final = root / name
        if parse_step_dir(name) is not None and not old.is_symlink() and not os.path.lexists(final):
            new = root / (TMP_PREFIX + name)
            if not new.is_symlink() and new.is_dir() and complete(new):
                os.replace(new, final)
                done.append(f"finished the interrupted re-save of {name}")
            else:
                os.replace(old, final)
                done.append(f"restored {name} (its re-save was interrupted)")
            fsync_dir(root)
    for p in sorted(root.glob(TMP_PREFIX + "*")):
        remove_tree(p)
        done.append(f"removed {p.name}")
    if os.path.lexists(root / LATEST_TMP):
        unlink_quietly(root / LATEST_TMP)
        done.append(f"removed {LATEST_TMP}")
    _RECOVERED.add(os.path.realpath(root))
    return done


def commit_step(root: Path, step: int, meta: StepMeta, reports: list, keep_last: int = 0,
                keep: Iterable[int] = ()) -> Path:
    """Commit the complete temporary folder `.tmp-step_N` (every coordinate written and fsynced, `reports` what
    each wrote) as step_N: manifest (checked, see manifest.write), fsync, rename (an existing step_N is swapped
    out atomically), then `latest` and the prune (tree.publish).

    The one commit of live saves (rank 0) and of `split`/`reshard`. On failure before the rename, the
    temporary folder is removed and CheckpointError says `latest` is unchanged; after the rename, the step
    is committed and the error says so.
    """
    tmp, final = root / tmp_dir(step), root / step_dir(step)
    try:
        write(tmp, meta, reports)  # refused if a reported file is not there: `latest` names no step missing one
        kill_point("manifest_written")
        fsync_dir(tmp)
        kill_point("manifest_synced")
        if os.path.lexists(final):  # re-saving a step (after a rollback): never a moment without step_N
            if _exchange(tmp, final):
                kill_point("resave_swapped")
                remove_tree(tmp)
            else:
                old = root / (OLD_PREFIX + step_dir(step))
                remove_tree(old)
                os.replace(final, old)
                kill_point("resave_old_moved")  # the window `recover` closes on the next start
                os.replace(tmp, final)
                remove_tree(old)
        else:
            os.replace(tmp, final)
        fsync_dir(root)
        kill_point("renamed")
    except Exception as e:  # noqa: BLE001 - OSError and CheckpointError alike: say what is left
        remove_tree(tmp)
        if not isinstance(e, (CheckpointError, OSError)):  # a bug: keep its traceback in the log
            traceback.print_exc(file=sys.stderr)
        msg = str(e) if isinstance(e, CheckpointError) else (getattr(e, "strerror", None) or str(e))
        raise CheckpointError(f"checkpoint step {step} was not saved ({msg}); {root / LATEST} still names "
                              f"{latest_or_nothing(root)}") from None
    try:
        publish(root, step, keep_last, keep)
    except OSError as e:
        raise CheckpointError(f"checkpoint step {step} was committed as {final} but {root / LATEST} could not "
                              f"be updated ({e.strerror or e}); it still names {latest_or_nothing(root)}") from None
    return final


def _write_failure(rank: int, rel: str, e: Exception) -> str:
    """An I/O error is the user's to fix: one line. Anything else is a bug: keep its traceback in this
    rank's log (stderr) and say where to find it."""
    if isinstance(e, OSError):
        return f"rank {rank} ({rel}) failed to write: {e.strerror or e}"
    traceback.print_exc(file=sys.stderr)
    return (f"rank {rank} ({rel}) failed to write: {type(e).__name__}: {e} "
            f"(a bug: the traceback is in rank {rank}'s log)")


def save_collective(root: Path, step: int, pay: Payload, grid, meta: StepMeta, keep_last: int = 0,
                    keep: Iterable[int] = (), direct: bool = False) -> Path:
    """Steps 1-4 of the protocol above. Every rank calls it; every rank returns or raises alike. `direct`:
    write_rank's files go around the page cache."""
    root = Path(root)
    tmp = root / tmp_dir(step)
    err, mine = None, os.path.realpath(root)
    if grid.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            recover_once(root)
            tmp.mkdir()
        except OSError as e:
            err = f"checkpoint step {step}: cannot create {tmp} ({e.strerror or e})"
    err, root0 = bcast_object((err, mine), grid, commit_groups(grid).every)
    if err:
        raise CheckpointError(err, shared=True)
    rel = coord_dir(grid.coord, grid.layout.cp)
    try:
        if mine != root0:  # this rank would write where rank 0 never looks: nothing written, the save refused
            raise CheckpointError(f"rank {grid.rank} saves under '{mine}', rank 0 under '{root0}' (every rank must "
                                  f"save into the same checkpoint folder)")
        report = write_rank(tmp / rel, pay, rel, direct)
        kill_point("slices_written")
    except CheckpointError as e:
        report = RankReport.failed(str(e))
    except Exception as e:  # noqa: BLE001 - every failure becomes the same error on all ranks
        report = RankReport.failed(_write_failure(grid.rank, rel, e))
    reports = _gather(report, grid)
    outcome = None
    if grid.rank == 0:
        failures = [e for r in reports for e in r.errors]
        try:
            if failures:
                remove_tree(tmp)
                raise CheckpointError(f"checkpoint step {step} was not saved ({failures[0]}); {root / LATEST} "
                                      f"still names {latest_or_nothing(root)}")
            commit_step(root, step, meta, reports, keep_last, keep)
        except CheckpointError as e:
            outcome = str(e)
    outcome = bcast_object(outcome, grid, commit_groups(grid).every)
    if outcome:
        _RECOVERED.discard(mine)  # a failed save may leave what the next one must put right first
        raise CheckpointError(outcome, shared=True)
    return root / step_dir(step)
