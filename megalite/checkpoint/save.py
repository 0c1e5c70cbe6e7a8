"""Per-coordinate writes, the atomic commit, keep_last, and asynchronous saves.

Commit protocol (all coordination on the grid's `aux` gloo group, never shared with training):
  1. rank 0 finishes or undoes what a killed save left (`recover`) and creates `.tmp-step_N/`;
  2. every rank writes its own `tpXX-ppXX-dpXX/` folder (safetensors + JSON), fsyncs, and reports the
     files with sizes and checksums (or its error) to rank 0, through its stage's leader (`_gather`);
  3. rank 0, if all succeeded, runs `commit_step` (the one commit, shared with `split`/`reshard`): writes
     manifest.json, fsyncs, moves `.tmp-step_N` -> `step_N` (a re-saved step is swapped in atomically),
     and only then replaces `latest`; then prunes. On any failure it removes the temporary folder;
  4. rank 0 broadcasts the outcome, and every rank returns or raises the same CheckpointError.

At every instant `latest` names a committed folder that verifies: a process killed at any point of the
protocol leaves at worst a `.tmp-*` folder that the next start finishes or removes (`recover`). The kill
points of megalite.faults (`kill_point`) sit at each boundary, and tests kill a rank at each in turn.

An async save (AsyncSaver) runs steps 1-4 in a background thread, on a snapshot taken without a copy where
the optimizer can hold its tensors (double buffering: its next step writes out of place).
"""
from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from .. import __version__
from ..faults import kill_point
from ..parallel.partition import partition_of, valid_view
from . import manifest as mf
from .tree import (LATEST, LATEST_TMP, MODEL_FILE, OPTIM_FILE, STATE_FILE, TMP_PREFIX, CheckpointError,
                     committed_steps, coord_dir, fsync_dir, parse_step_dir, plan_writes, read_latest, remove_tree,
                     step_dir, tmp_dir, unlink_quietly, write_latest)
from .state import dumps_json
from .stream import StreamingWriter, crc32c


@dataclass
class Payload:
    """What one rank writes: tensors per file (key -> tensor), their manifest records, and its state.json."""
    files: dict = field(default_factory=dict)  # file name -> {key: tensor}
    records: list = field(default_factory=list)  # (TensorEntry without slices, WriteItem) per slice
    state: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # other files of the folder, name -> bytes (rank 0: tokenizer.json)


def collect(params, optimizer, grid, state: dict) -> Payload:
    """This coordinate's share of the live state (plan_writes decides which); tensors are views (an async
    save holds them or copies them to host buffers, see AsyncSaver)."""
    c, L = grid.coord, grid.layout
    live = dict(params)
    items = plan_writes([(n, partition_of(p)) for n, p in params], c, L, optimizer=optimizer is not None)
    pay = Payload(files={MODEL_FILE: {}, OPTIM_FILE: {}}, state=state)
    for it in items:
        p = live[it.name]
        part = partition_of(p)
        a, b = it.flat or (0, it.box.numel)
        if it.kind == "model":
            t = valid_view(p.detach(), part, c.tp, L.tp).reshape(-1)[a:b]
        else:  # the moments this rank holds start at piece_of's start (ZeRO-1: exactly the planned piece)
            store = optimizer.exp_avg if it.kind == "exp_avg" else optimizer.exp_avg_sq
            start = optimizer.piece_of(it.name)[0]
            t = store[it.name][a - start:b - start]
        add(pay, it, part, t if it.flat else t.view(it.box.shape))
    return pay


def add(pay: Payload, it, part, tensor) -> None:
    """Put one planned slice into the payload, with its manifest record (the tensor's real dtype)."""
    pay.files.setdefault(it.file, {})[it.key] = tensor
    proto = mf.TensorEntry(it.key, it.kind, mf.dtype_name(tensor.dtype), tuple(part.global_shape), part)
    pay.records.append((proto, it))


class Stager:
    """Host copies of a payload in buffers reused from one save to the next (async saves).

    A tensor `keep` accepts is passed through uncopied: a host parameter or moment of an optimizer that
    `hold`s it (megalite's ShardedAdamW: its next step writes out of place, see AsyncSaver)."""

    def __init__(self):
        self.buffers: dict = {}

    def _buffer(self, fname: str, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get((fname, key))
        if buf is None or buf.shape != t.shape:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            buf.zero_()  # touch the pages now, not during the first save's stall
            self.buffers[(fname, key)] = buf
        return buf

    def reserve(self, pay: Payload, keep=lambda t: False) -> None:
        """Allocate every buffer up front (at start-up), so even the first async save only copies."""
        for fname, tensors in pay.files.items():
            for key, t in tensors.items():
                if not keep(t):
                    self._buffer(fname, key, t)

    def stage(self, pay: Payload, keep=lambda t: False) -> Payload:
        """The payload with every tensor `keep` refuses copied to its host buffer (the rest passed as is)."""
        out = Payload(files={}, records=pay.records, state=pay.state, extra=pay.extra)
        for fname, tensors in pay.files.items():
            out.files[fname] = {}
            for key, t in tensors.items():
                if keep(t):
                    out.files[fname][key] = t
                    continue
                buf = self._buffer(fname, key, t)
                buf.copy_(t, non_blocking=True)
                out.files[fname][key] = buf
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return out


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_tensors(path: Path, tensors: dict, block: int) -> tuple[int, str, dict]:
    """Stream one safetensors file (keys sorted: the same state gives the same bytes); return its size,
    its header's CRC32C and each tensor's block CRC32Cs, computed on the buffers as they are written."""
    keys = sorted(tensors)
    w = StreamingWriter(path, [(k, list(tensors[k].shape), tensors[k].dtype) for k in keys], {"format": "pt"},
                        block=block)
    try:
        crcs = {k: tuple(w.write(k, tensors[k])) for k in keys}
        w.close()
    except BaseException:
        w.abort()
        raise
    return w.size, f"{w.header_crc32c:08x}", crcs


def write_rank(folder: Path, pay: Payload, rel: str) -> dict:
    """Write one coordinate's folder; return its report for the manifest (see manifest.build)."""
    block = mf.BLOCK_BYTES
    folder.mkdir(parents=True, exist_ok=True)
    report = {"files": {}, "tensors": []}
    crcs = {}
    for fname, tensors in pay.files.items():
        size, crc, crcs[fname] = _write_tensors(folder / fname, tensors, block)
        report["files"][f"{rel}/{fname}"] = mf.FileRecord(size, crc)
    data = dumps_json(pay.state).encode()
    _write_file(folder / STATE_FILE, data)
    report["files"][f"{rel}/{STATE_FILE}"] = mf.FileRecord(len(data), f"{crc32c(data):08x}")
    for name, data in pay.extra.items():
        _write_file(folder / name, data)
        report["files"][f"{rel}/{name}"] = mf.FileRecord(len(data), f"{crc32c(data):08x}")
    for proto, it in pay.records:
        sl = mf.SliceRef(f"{rel}/{it.file}", it.key, it.box, it.flat, crcs[it.file][it.key])
        report["tensors"].append((proto, sl))
    fsync_dir(folder)
    return report


# ---------------------------------------------------------------- collective helpers (world of one allowed)
def bcast_object(obj, grid, group=None):
    """Rank 0's `obj` on every rank (on `group`, by default the checkpoint's own aux group)."""
    if grid.layout.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group or grid.aux)
    return box[0]


def merge_reports(reports: list) -> dict:
    """One report holding several ranks' (a stage leader's part): their files and slices, and their errors."""
    out = {"files": {}, "tensors": [], "errors": []}
    for r in reports:
        if "error" in r:
            out["errors"].append(r["error"])
        else:
            out["files"].update(r["files"])
            out["tensors"] += r["tensors"]
            out["errors"] += r.get("errors", [])
    return out


def _gather_object(obj, axis) -> Optional[list]:
    """Every member's `obj` on the axis' rank 0 (None elsewhere)."""
    if not axis.active:
        return [obj]
    out = [None] * axis.size if axis.rank == 0 else None
    dist.gather_object(obj, out, group=axis.group, group_dst=0)
    return out


def _gather(report: dict, grid) -> Optional[list]:
    """Every rank's report on rank 0, in two levels so that no rank receives a message per rank: the
    ranks of each pipeline stage send theirs to the stage's leader (its first rank), which merges them;
    rank 0 (the leader of stage 0) then gathers the pp merged parts. Rank 0 receives tp*dp - 1 + pp - 1
    messages instead of world - 1, and the stages gather in parallel. None on every other rank."""
    part = _gather_object(report, grid.aux_stage)
    if part is None:
        return None
    merged = merge_reports(part)
    return _gather_object(merged, grid.aux_leaders)


OLD_PREFIX = TMP_PREFIX + "old-"  # a step being replaced, kept until its replacement is in place


def _exchange(a: Path, b: Path) -> bool:
    """Swap two folders in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    if os.environ.get("MEGALITE_NO_RENAME_EXCHANGE"):  # tests: exercise the two-rename fallback
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def _complete(folder: Path) -> bool:
    from .verify import verify
    return (folder / "manifest.json").is_file() and not verify(folder)[1]


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
            if not new.is_symlink() and new.is_dir() and _complete(new):
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
    return done


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
    steps = sorted(s for s in committed_steps(root) if saved is None or s <= saved)
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


def commit_step(root: Path, step: int, man: dict, keep_last: int = 0, keep: Iterable[int] = ()) -> Path:
    """Commit the complete temporary folder `.tmp-step_N` (every coordinate written and fsynced) as step_N:
    manifest, fsync, rename (an existing step_N is swapped out atomically), then `latest`, then prune.

    The one commit of live saves (rank 0) and of `split`/`reshard`. On failure before the rename, the
    temporary folder is removed and CheckpointError says `latest` is unchanged; after the rename, the step
    is committed and the error says so.
    """
    tmp, final = root / tmp_dir(step), root / step_dir(step)
    try:
        mf.write(tmp, man)
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
                              f"{_latest_or_nothing(root)}") from None
    try:
        write_latest(root, step_dir(step))
    except OSError as e:
        raise CheckpointError(f"checkpoint step {step} was committed as {final} but {root / LATEST} could not "
                              f"be updated ({e.strerror or e}); it still names {_latest_or_nothing(root)}") from None
    kill_point("latest_written")
    prune(root, keep_last, step, keep)
    return final


def _latest_or_nothing(root: Path) -> str:
    try:
        return read_latest(root) or "nothing"
    except CheckpointError:
        return "something unreadable"


def _write_failure(rank: int, rel: str, e: Exception) -> str:
    """An I/O error is the user's to fix: one line. Anything else is a bug: keep its traceback in this
    rank's log (stderr) and say where to find it."""
    if isinstance(e, OSError):
        return f"rank {rank} ({rel}) failed to write: {e.strerror or e}"
    traceback.print_exc(file=sys.stderr)
    return (f"rank {rank} ({rel}) failed to write: {type(e).__name__}: {e} "
            f"(a bug: the traceback is in rank {rank}'s log)")


def save_collective(root: Path, step: int, pay: Payload, grid, meta: dict, keep_last: int = 0,
                    keep: Iterable[int] = ()) -> Path:
    """Steps 1-4 of the protocol above. Every rank calls it; every rank returns or raises alike."""
    root = Path(root)
    tmp = root / tmp_dir(step)
    err = None
    if grid.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            recover(root)
            tmp.mkdir()
        except OSError as e:
            err = f"checkpoint step {step}: cannot create {tmp} ({e.strerror or e})"
    err = bcast_object(err, grid)
    if err:
        raise CheckpointError(err, shared=True)
    rel = coord_dir(grid.coord)
    try:
        report = write_rank(tmp / rel, pay, rel)
        kill_point("slices_written")
    except Exception as e:  # noqa: BLE001 - every failure becomes the same error on all ranks
        report = {"error": _write_failure(grid.rank, rel, e)}
    reports = _gather(report, grid)
    outcome = None
    if grid.rank == 0:
        failures = [e for r in reports for e in r["errors"]]
        try:
            if failures:
                remove_tree(tmp)
                raise CheckpointError(f"checkpoint step {step} was not saved ({failures[0]}); {root / LATEST} "
                                      f"still names {_latest_or_nothing(root)}")
            commit_step(root, step, mf.build(meta, reports), keep_last, keep)
        except CheckpointError as e:
            outcome = str(e)
    outcome = bcast_object(outcome, grid)
    if outcome:
        raise CheckpointError(outcome, shared=True)
    return root / step_dir(step)


def manifest_meta(cfg_dict: dict, layout, zero1: bool, step: int, tokens_seen: int, optimizer,
                  sampler_state: dict, client_state: Optional[dict]) -> dict:
    """Everything in the manifest that is not about files and slices (see manifest.build)."""
    return {"megalite_version": __version__, "torch_version": torch.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "step": step, "tokens_seen": tokens_seen,
            "layout": tuple(layout), "zero1": bool(zero1), "config": cfg_dict, "data": sampler_state,
            "optimizer": None if optimizer is None else {
                "type": "adamw", "step": optimizer.step_count, "betas": list(optimizer.betas),
                "eps": optimizer.eps, "weight_decay": optimizer.weight_decay},
            "client_state": client_state or {}}


class AsyncSaver:
    """At most one save in flight; everything but taking the snapshot (the checksums, the writes, the
    commit) runs in a thread, and a failure there is kept and raised by the next `poll()`/`wait()` in the
    training loop.

    The snapshot costs the caller no copy where the optimizer can `hold` the tensors (megalite's
    ShardedAdamW, host tensors): the thread writes the live parameters and moments themselves, and the
    optimizer's next step computes its update out of place into a spare set, so the bytes being written
    never change (double buffering; the step does the same arithmetic as in place).
    Anything else (device tensors, a torch.optim optimizer's state, parameters no optimizer holds) is
    copied first into host buffers reused from one save to the next, as DCP's async_save does.
    """

    def __init__(self, zero_copy: bool = True):
        self.stager = Stager()
        self.zero_copy = zero_copy  # False: copy every tensor (what `megalite bench ckpt` compares against)
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None
        self.last: Optional[Path] = None

    def held_keys(self, pay: Payload, optimizer) -> list:
        """The optimizer's keys of the payload tensors it can hold uncopied (whole host tensors it writes)."""
        if not self.zero_copy or not hasattr(optimizer, "hold"):
            return []
        return [k for ts in pay.files.values() for k in map(optimizer.holdable, ts.values()) if k is not None]

    def reserve(self, pay: Payload, optimizer=None) -> None:
        """At start-up: the optimizer's spare buffers, and host buffers for whatever it cannot hold."""
        keys = self.held_keys(pay, optimizer)
        if keys:
            optimizer.reserve_spare(keys)
        self.stager.reserve(pay, lambda t: bool(keys) and optimizer.holdable(t) is not None)

    def submit(self, root, step, pay, grid, meta, keep_last, keep=(), optimizer=None) -> None:
        self.wait()  # the previous save's tensors are free again (a held tensor's old buffer becomes its spare)
        keys = self.held_keys(pay, optimizer)
        staged = self.stager.stage(pay, lambda t: bool(keys) and optimizer.holdable(t) is not None)
        if keys:
            optimizer.hold(keys, self.wait)

        def run():
            try:
                if grid.layout.world_size > 1:  # write once every rank has its snapshot: ranks sharing a
                    dist.barrier(group=grid.aux)  # host's cores never slow another's copy with their writes
                self.last = save_collective(root, step, staged, grid, meta, keep_last, keep)
            except BaseException as e:  # noqa: BLE001
                self.error = e

        self.thread = threading.Thread(target=run, name=f"megalite-ckpt-{step}", daemon=True)
        self.thread.start()

    def poll(self) -> None:
        if self.thread is not None and not self.thread.is_alive():
            self.wait()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            e, self.error = self.error, None
            raise e
