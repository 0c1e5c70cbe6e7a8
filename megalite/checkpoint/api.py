"""save_checkpoint / load_checkpoint: the checkpoint engine's two calls (the shape of DeepSpeed's, but a
missing checkpoint is an error, never a silent None).

    save_checkpoint(root, step, model, optimizer, grid, client_state={"epoch": 3})
    info = load_checkpoint(root, model, optimizer, grid)    # info.client_state == {"epoch": 3}

`model` is megalite's GPT stage or any torch.nn.Module (global names: `global_parameters()` if it has one, else
`named_parameters()`; untagged parameters are replicated, `parallel.partition.shard` splits one over tp);
`optimizer` is megalite's ShardedAdamW, any torch.optim optimizer (optimizer.py) or None.

A save goes: the optimizer's owner (optimizer.py) -> this rank's payload (plan.py) -> the step's meta
(manifest.step_meta) -> the commit protocol (commit.py, in a thread with async_save.py), which writes the
rank's folder (write.py) and commits the step.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from .async_save import AsyncSaver
from .commit import save_collective
from .load import Loaded, load_into
from .manifest import step_meta
from .optimizer import optimizer_state
from .plan import collect
from .state import StepState
from .tree import TOKENIZER_FILE


def global_named(model) -> list:
    """The model's parameters by global name, sorted: `global_parameters()` if it has one (a pipeline stage
    names its layers globally), else `named_parameters()`."""
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
    named = global_named(model)
    opt = optimizer_state(optimizer)
    section = opt.section(named, grid)  # first: with torch.optim, a collective that checks every rank's state
    sched = scheduler.state_dict() if scheduler is not None else None
    pay = collect(named, opt, grid, StepState.capture(step, tokens_seen, data_state, sched))
    meta = step_meta(step, grid.layout, config, tokens_seen=tokens_seen, data=data_state, zero1=opt.zero1,
                     optimizer=section, client_state=client_state, scheduler=sched)
    if tokenizer is not None and grid.rank == 0:
        pay.step_files[TOKENIZER_FILE] = bytes(tokenizer)
    if saver is not None:
        saver.submit(Path(root), step, pay, grid, meta, keep_last, keep, optimizer)
        return None
    return save_collective(Path(root), step, pay, grid, meta, keep_last, keep)


def load_checkpoint(path, model, optimizer, grid, *, scheduler=None, model_config: Optional[dict] = None) -> Loaded:
    """Load into this rank's slice (any layout; resharded on the fly). Raises CheckpointError if absent."""
    info = load_into(path, global_named(model), optimizer, grid, model_config)
    if scheduler is not None and info.manifest.scheduler is not None:
        scheduler.load_state_dict(info.manifest.scheduler)
    return info
