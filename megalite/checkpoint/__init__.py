"""Rank-coded sharded checkpoints: every (tp, pp, dp) coordinate saves its own slice; one manifest describes all.

    tree.py      the tree: coordinate <-> folder, step folders, `latest`
    manifest.py  the global description (names, shapes, partitions, slices, checksums)
    save.py      per-coordinate writes, atomic commit, keep_last, async saves
    load.py      checks and loads into a model/optimizer at any layout
    read.py      reads any region of a global tensor from whichever slices hold it
    torch_optim.py  any torch.optim optimizer's state, saved and resharded like its parameters
    verify.py    `verify` and `inspect`

The public API (the shape of DeepSpeed's save_checkpoint/load_checkpoint, but a missing checkpoint is an
error, never a silent None):

    save_checkpoint(root, step, model, optimizer, grid, client_state={"epoch": 3})
    info = load_checkpoint(root, model, optimizer, grid)    # info.client_state == {"epoch": 3}

`model` is megalite's GPT stage or any torch.nn.Module (global names: `global_parameters()` if it has one, else
`named_parameters()`; untagged parameters are replicated, `parallel.partition.shard` splits one over tp);
`optimizer` is megalite's ShardedAdamW, any torch.optim optimizer (see torch_optim.py) or None.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from .tree import TOKENIZER_FILE, CheckpointError, resolve
from .load import Loaded, load_into
from .save import AsyncSaver, collect, manifest_meta, save_collective
from .state import capture_rng
from . import torch_optim

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "resolve", "AsyncSaver", "Loaded"]


def _named(model) -> list:
    if hasattr(model, "global_parameters"):
        return sorted(model.global_parameters(), key=lambda np_: np_[0])
    return sorted(model.named_parameters(), key=lambda np_: np_[0])


def save_checkpoint(root, step: int, model, optimizer, grid, *, scheduler=None, client_state: Optional[dict] = None,
                    config: Optional[dict] = None, tokens_seen: int = 0, data_state: Optional[dict] = None,
                    keep_last: int = 0, saver: Optional[AsyncSaver] = None, keep=(),
                    tokenizer: Optional[bytes] = None) -> Optional[Path]:
    """Save this rank's slice under root/step_NNNNNNNN (all ranks call it). Returns the committed folder,
    or None when `saver` is given (async: the commit happens in the background; call saver.wait()). With
    megalite's optimizer the async snapshot is the live host tensors themselves (no copy): let only
    `optimizer.step` change them until saver.wait() (load_checkpoint with that optimizer waits by itself).
    keep_last prunes older steps (never the one `latest` names, one newer than `step`, or one in `keep`).
    `tokenizer`: the run's tokenizer.json, which rank 0 writes into its folder (tp00-pp00-dp00)."""
    if config is None and hasattr(model, "cfg"):  # enough for `megalite train` and the converter to use it
        config = {"model": dataclasses.asdict(model.cfg)}
    data_state = data_state or {"batch_index": step}
    state = {"step": step, "tokens_seen": tokens_seen, "rng": capture_rng(), "data": data_state,
             "scheduler": scheduler.state_dict() if scheduler is not None else None}
    if torch_optim.is_torch(optimizer):  # any torch.optim optimizer: its state follows its parameters
        section, tensors = torch_optim.describe(_named(model), optimizer, grid)
        pay = collect(_named(model), None, grid, state)
        torch_optim.add_state(pay, tensors, grid)
        meta = manifest_meta(config or {}, grid.layout, False, step, tokens_seen, None, data_state, client_state)
        meta["optimizer"] = section
    else:  # megalite's ShardedAdamW (ZeRO-1 pieces) or None
        pay = collect(_named(model), optimizer, grid, state)
        meta = manifest_meta(config or {}, grid.layout, getattr(optimizer, "zero1", False), step, tokens_seen,
                             optimizer, data_state, client_state)
    meta["scheduler"] = state["scheduler"]
    if tokenizer is not None and grid.rank == 0:
        pay.extra[TOKENIZER_FILE] = bytes(tokenizer)
    if saver is not None:
        saver.submit(Path(root), step, pay, grid, meta, keep_last, keep, optimizer)
        return None
    return save_collective(Path(root), step, pay, grid, meta, keep_last, keep)


def load_checkpoint(path, model, optimizer, grid, *, scheduler=None, model_config: Optional[dict] = None) -> Loaded:
    """Load into this rank's slice (any layout; resharded on the fly). Raises CheckpointError if absent."""
    info = load_into(path, _named(model), optimizer, grid, model_config)
    if scheduler is not None and info.manifest.scheduler is not None:
        scheduler.load_state_dict(info.manifest.scheduler)
    return info
