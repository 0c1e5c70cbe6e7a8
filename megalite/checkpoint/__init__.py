"""Rank-coded sharded checkpoints: every (tp, pp, dp) coordinate saves its own slice; one manifest describes all.

    layout.py    the tree: coordinate <-> folder, step folders, `latest`
    manifest.py  the global description (names, shapes, partitions, slices, checksums)
    save.py      per-coordinate writes, atomic commit, keep_last, async saves
    load.py      checks and loads into a model/optimizer at any layout
    reshard.py   reads any region of a global tensor from whichever slices hold it
    verify.py    `verify` and `inspect`

The public API (the shape of DeepSpeed's save_checkpoint/load_checkpoint, but a missing checkpoint is an
error, never a silent None):

    save_checkpoint(root, step, model, optimizer, grid, client_state={"epoch": 3})
    info = load_checkpoint(root, model, optimizer, grid)    # info.client_state == {"epoch": 3}
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from .layout import CheckpointError, resolve
from .load import Loaded, load_into
from .save import AsyncSaver, collect, manifest_meta, save_collective
from .state import capture_rng

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "resolve", "AsyncSaver", "Loaded"]


def _named(model) -> list:
    if hasattr(model, "global_parameters"):
        return sorted(model.global_parameters(), key=lambda np_: np_[0])
    return sorted(model.named_parameters(), key=lambda np_: np_[0])


def save_checkpoint(root, step: int, model, optimizer, grid, *, scheduler=None, client_state: Optional[dict] = None,
                    config: Optional[dict] = None, tokens_seen: int = 0, data_state: Optional[dict] = None,
                    keep_last: int = 0, saver: Optional[AsyncSaver] = None) -> Optional[Path]:
    """Save this rank's slice under root/step_NNNNNNNN (all ranks call it). Returns the committed folder,
    or None when `saver` is given (async: the commit happens in the background; call saver.wait())."""
    if config is None and hasattr(model, "cfg"):  # enough for `megalite train` and the converter to use it
        config = {"model": dataclasses.asdict(model.cfg)}
    data_state = data_state or {"batch_index": step}
    state = {"step": step, "tokens_seen": tokens_seen, "rng": capture_rng(), "data": data_state,
             "scheduler": scheduler.state_dict() if scheduler is not None else None}
    pay = collect(_named(model), optimizer, grid, state)
    meta = manifest_meta(config or {}, grid.layout, getattr(optimizer, "zero1", False), step, tokens_seen,
                         optimizer, data_state, client_state)
    meta["scheduler"] = state["scheduler"]
    if saver is not None:
        saver.submit(Path(root), step, pay, grid, meta, keep_last)
        return None
    return save_collective(Path(root), step, pay, grid, meta, keep_last)


def load_checkpoint(path, model, optimizer, grid, *, scheduler=None, model_config: Optional[dict] = None) -> Loaded:
    """Load into this rank's slice (any layout; resharded on the fly). Raises CheckpointError if absent."""
    info = load_into(path, _named(model), optimizer, grid, model_config)
    if scheduler is not None and info.manifest.scheduler is not None:
        scheduler.load_state_dict(info.manifest.scheduler)
    return info
