"""Per-coordinate writes, the atomic commit, keep_last, and asynchronous saves.

Commit protocol (all coordination on the grid's `aux` gloo group, never shared with training):
  1. rank 0 removes stale `.tmp-step_*` folders of killed runs and creates `.tmp-step_N/`;
  2. every rank writes its own `tpXX-ppXX-dpXX/` folder (safetensors + JSON), fsyncs, and reports the
     files with sizes and checksums (or its error) to rank 0;
  3. rank 0, if all succeeded, writes manifest.json, fsyncs, renames `.tmp-step_N` -> `step_N`, and only
     then replaces `latest`; then prunes to keep_last. On any failure it removes the temporary folder;
  4. rank 0 broadcasts the outcome, and every rank returns or raises the same CheckpointError.
"""
from __future__ import annotations

import os
import shutil
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from .. import __version__
from ..parallel.tensor import partition_of, valid_view
from . import manifest as mf
from .layout import (MODEL_FILE, OPTIM_FILE, STATE_FILE, TMP_PREFIX, CheckpointError, committed_steps,
                     coord_dir, fsync_dir, plan_writes, read_latest, step_dir, tmp_dir, write_latest)
from .state import dumps_json
from .stream import StreamingWriter


@dataclass
class Payload:
    """What one rank writes: tensors per file (key -> tensor), their manifest records, and its state.json."""
    files: dict = field(default_factory=dict)  # file name -> {key: tensor}
    records: list = field(default_factory=list)  # (TensorEntry without slices, WriteItem) per slice
    state: dict = field(default_factory=dict)


def collect(params, optimizer, grid, state: dict) -> Payload:
    """This coordinate's share of the live state (plan_writes decides which); tensors are views, staged
    to host buffers later if the save is asynchronous."""
    c, L = grid.coord, grid.layout
    live = dict(params)
    items = plan_writes([(n, partition_of(p)) for n, p in params], c, L,
                        zero1=bool(optimizer is not None and optimizer.zero1), optimizer=optimizer is not None)
    pay = Payload(files={MODEL_FILE: {}, OPTIM_FILE: {}}, state=state)
    for it in items:
        p = live[it.name]
        part = partition_of(p)
        if it.kind == "model":
            t = valid_view(p.detach(), part, c.tp, L.tp)
        else:
            store = optimizer.exp_avg if it.kind == "exp_avg" else optimizer.exp_avg_sq
            t = store[it.name] if it.flat else store[it.name].view([e - s for s, e in it.box])
        add(pay, it, part, t)
    return pay


def add(pay: Payload, it, part, tensor) -> None:
    """Put one planned slice into the payload, with its manifest record (the tensor's real dtype)."""
    pay.files.setdefault(it.file, {})[it.key] = tensor
    proto = mf.TensorEntry(it.key, it.kind, mf.dtype_name(tensor.dtype), tuple(part.global_shape), part)
    pay.records.append((proto, it))


class Stager:
    """Host copies of a payload in buffers reused from one save to the next (async saves)."""

    def __init__(self):
        self.buffers: dict = {}

    def _buffer(self, fname: str, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get((fname, key))
        if buf is None or buf.shape != t.shape:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            buf.zero_()  # touch the pages now, not during the first save's stall
            self.buffers[(fname, key)] = buf
        return buf

    def reserve(self, pay: Payload) -> None:
        """Allocate every buffer up front (at start-up), so even the first async save only copies."""
        for fname, tensors in pay.files.items():
            for key, t in tensors.items():
                self._buffer(fname, key, t)

    def stage(self, pay: Payload) -> Payload:
        out = Payload(files={}, records=pay.records, state=pay.state)
        for fname, tensors in pay.files.items():
            out.files[fname] = {}
            for key, t in tensors.items():
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
    its header's CRC32 and each tensor's block CRC32s, computed on the buffers as they are written."""
    keys = sorted(tensors)
    w = StreamingWriter(path, [(k, list(tensors[k].shape), tensors[k].dtype) for k in keys], {"format": "pt"},
                        block=block)
    try:
        crcs = {k: tuple(w.write(k, tensors[k])) for k in keys}
        w.close()
    except BaseException:
        w.abort()
        raise
    return w.size, f"{w.header_crc32:08x}", crcs


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
    report["files"][f"{rel}/{STATE_FILE}"] = mf.FileRecord(len(data), f"{mf.crc32_bytes(data):08x}")
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


def _gather(obj, grid) -> Optional[list]:
    if grid.layout.world_size == 1:
        return [obj]
    out = [None] * grid.layout.world_size if grid.rank == 0 else None
    dist.gather_object(obj, out, dst=0, group=grid.aux)
    return out


def remove_stale_tmp(root: Path) -> None:
    for p in root.glob(TMP_PREFIX + "*"):
        shutil.rmtree(p, ignore_errors=True)


def prune(root: Path, keep_last: int) -> list[int]:
    """Delete the oldest committed steps beyond keep_last; never the one `latest` names."""
    if keep_last <= 0:
        return []
    latest = read_latest(root)
    steps = committed_steps(root)
    doomed = [s for s in steps[:-keep_last] if step_dir(s) != latest]
    for s in doomed:
        shutil.rmtree(root / step_dir(s), ignore_errors=True)
    return doomed


def commit_step(root: Path, step: int, tmp: Path, meta: dict, reports: list[dict]) -> Path:
    """Step 3 of the protocol (rank 0, or the one process of an offline write): the manifest into the
    finished temporary folder, fsync, rename it to step_N, and only then replace `latest`."""
    mf.write(tmp, mf.build(meta, reports))
    fsync_dir(tmp)
    final = root / step_dir(step)
    if final.exists():  # re-saving a step (e.g. after a resume): move the old one aside first
        old = root / (TMP_PREFIX + "old-" + step_dir(step))
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(root)
    write_latest(root, step_dir(step))
    return final


def _write_failure(rank: int, rel: str, e: Exception) -> str:
    """An I/O error is the user's to fix: one line. Anything else is a bug: keep its traceback in this
    rank's log (stderr) and say where to find it."""
    if isinstance(e, OSError):
        return f"rank {rank} ({rel}) failed to write: {e.strerror or e}"
    traceback.print_exc(file=sys.stderr)
    return (f"rank {rank} ({rel}) failed to write: {type(e).__name__}: {e} "
            f"(a bug: the traceback is in rank {rank}'s log)")


def save_collective(root: Path, step: int, pay: Payload, grid, meta: dict, keep_last: int = 0) -> Path:
    """Steps 1-4 of the protocol above. Every rank calls it; every rank returns or raises alike."""
    root = Path(root)
    tmp = root / tmp_dir(step)
    err = None
    if grid.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            remove_stale_tmp(root)
            tmp.mkdir()
        except OSError as e:
            err = f"checkpoint step {step}: cannot create {tmp} ({e.strerror or e})"
    err = bcast_object(err, grid)
    if err:
        raise CheckpointError(err)
    rel = coord_dir(grid.coord)
    try:
        report = write_rank(tmp / rel, pay, rel)
    except Exception as e:  # noqa: BLE001 - every failure becomes the same error on all ranks
        report = {"error": _write_failure(grid.rank, rel, e)}
    reports = _gather(report, grid)
    outcome = None
    if grid.rank == 0:
        failures = [r["error"] for r in reports if "error" in r]
        try:
            if failures:
                raise CheckpointError(failures[0])
            commit_step(root, step, tmp, meta, reports)
            prune(root, keep_last)
        except Exception as e:  # noqa: BLE001
            shutil.rmtree(tmp, ignore_errors=True)
            if not isinstance(e, (CheckpointError, OSError)):
                traceback.print_exc(file=sys.stderr)
            msg = str(e) if isinstance(e, CheckpointError) else (getattr(e, "strerror", None) or str(e))
            outcome = (f"checkpoint step {step} was not saved ({msg}); "
                       f"{root / 'latest'} still names {read_latest(root) or 'nothing'}")
    outcome = bcast_object(outcome, grid)
    if outcome:
        raise CheckpointError(outcome)
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
    """At most one save in flight: the caller blocks only for staging; writing and commit run in a thread.

    A failure in the thread is kept and raised by the next `poll()`/`wait()` in the training loop.
    """

    def __init__(self):
        self.stager = Stager()
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None
        self.last: Optional[Path] = None

    def submit(self, root, step, pay, grid, meta, keep_last) -> None:
        self.wait()
        staged = self.stager.stage(pay)

        def run():
            try:
                self.last = save_collective(root, step, staged, grid, meta, keep_last)
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
