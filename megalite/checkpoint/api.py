"""save_checkpoint / load_checkpoint: the checkpoint engine's two calls (the shape of DeepSpeed's, but a
missing checkpoint is an error, never a silent None).

    save_checkpoint(root, step, model, optimizer, grid, scheduler=sched, client_state={"epoch": 3})
    info = load_checkpoint(root, model, optimizer, grid, scheduler=sched)    # info.client_state == {"epoch": 3}

What comes back exactly (bring your own state):
  - the model's whole state_dict: megalite's GPT stage by the global names of `global_parameters()`; any
    other torch.nn.Module by `state_dict()`'s names, parameters and persistent buffers as torch defines them
    (BatchNorm's running statistics and its 0-dim int64 `num_batches_tracked`), any dtype of manifest.DTYPES,
    0-dim included. Untagged tensors are replicated; `parallel.partition.shard` splits a parameter over tp.
    Loading is as strict as torch's `load_state_dict`: a key the model has and the checkpoint lacks, or one
    the checkpoint has and no rank's model holds, is an error naming the keys, before anything changes;
  - the optimizer: megalite's ShardedAdamW, any torch.optim optimizer (optimizer.py) or None;
  - the scheduler's state_dict, through jsonio's exact codec (MultiStepLR's Counter of int milestones and
    ReduceLROnPlateau's infinite `best` come back as they were);
  - client_state: plain JSON (a dict of str keys, lists, strings, finite numbers, booleans, null).
Everything a save could refuse (a tensor type, a dtype, a zero-element tensor, a scheduler value, a
client_state that is not JSON, a config that is not megalite's) is checked on every rank and agreed before
any rank writes: every rank raises the same one-line CheckpointError and nothing is written.

A save goes: the checks -> the optimizer's owner (optimizer.py) -> this rank's payload (plan.py) -> the
step's meta (manifest.step_meta) -> the commit protocol (commit.py, in a thread with async_save.py), which
writes the rank's folder (commit.write_rank) and commits the step.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import torch

from ..base.errors import CheckpointError
from ..base.jsonio import NotEncodable, decode, encode, plain_problem
from .async_save import AsyncSaver
from ..parallel.agree import agreed, everyone
from .commit import commit_groups, save_collective
from .load import Loaded, load_into
from .manifest import DTYPES, check_meta, step_meta
from .optimizer import optimizer_state
from .plan import collect
from .state import StepState
from .tree import ORIGIN_FILE, TOKENIZER_FILE


def model_state(model) -> tuple[list, frozenset]:
    """([(global name, tensor)] sorted by name, the names that are buffers): megalite's stage by
    `global_parameters()` (it has no buffers); any other module by `state_dict(keep_vars=True)`, i.e. its
    parameters and persistent buffers under torch's own names (the tensors themselves, not copies)."""
    if hasattr(model, "global_parameters"):
        return sorted(model.global_parameters(), key=lambda np_: np_[0]), frozenset()
    state = model.state_dict(keep_vars=True)
    return sorted(state.items(), key=lambda kv: kv[0]), frozenset(
        k for k, v in state.items() if not isinstance(v, torch.nn.Parameter))


def global_named(model) -> list:
    """The model's state by global name, sorted (see model_state)."""
    return model_state(model)[0]


def check_model_state(named, chunked: frozenset = frozenset()) -> None:
    """Every entry of the state a checkpoint can hold: a tensor of a stored dtype with at least one element
    (but those in `chunked`: a ZeRO-3 rank's parameters, empty between steps, whose chunks its optimizer holds)."""
    for name, t in named:
        if not torch.is_tensor(t):
            raise CheckpointError(f"model state '{name}' is a {type(t).__name__}, not a tensor (a module's "
                                  f"get_extra_state() is not checkpointed: keep such state in client_state)")
        if t.dtype not in DTYPES.values():
            raise CheckpointError(f"model state '{name}' is {t.dtype} (expected one of {', '.join(DTYPES)})")
        if t.numel() == 0 and name not in chunked:
            raise CheckpointError(f"model state '{name}' has shape {list(t.shape)}: a tensor with no elements "
                                  f"cannot be checkpointed")


def encode_scheduler(scheduler) -> Optional[dict]:
    """The scheduler's state_dict through jsonio's exact codec (None without a scheduler)."""
    if scheduler is None:
        return None
    try:
        return encode(scheduler.state_dict(), "scheduler")
    except NotEncodable as e:
        raise CheckpointError(f"scheduler state: {e}") from None


def save_checkpoint(root, step: int, model, optimizer, grid, *, scheduler=None, client_state: Optional[dict] = None,
                    config: Optional[dict] = None, tokens_seen: int = 0, data_state: Optional[dict] = None,
                    keep_last: int = 0, saver: Optional[AsyncSaver] = None, keep=(),
                    tokenizer: Optional[bytes] = None, origin: Optional[bytes] = None,
                    direct: bool = False) -> Optional[Path]:
    """Save this rank's slice under root/step_NNNNNNNN (all ranks call it). Returns the committed folder,
    or None when `saver` is given (async: the commit happens in the background; call saver.wait()). With
    megalite's optimizer the async snapshot is the live host tensors themselves (no copy): let only
    `optimizer.step` change them until saver.wait() (load_checkpoint with that optimizer waits by itself).
    keep_last prunes older steps (never the one `latest` names, one newer than `step`, or one in `keep`).
    `tokenizer`: the run's tokenizer.json, which rank 0 writes into its folder (tp00-pp00-dp00); `origin`: the
    model's origin.json beside it (base/origin.py: its source's tokenizer files, dtype and ids).
    `direct`: the safetensors files are written around the page cache (O_DIRECT; the same bytes), which spares
    a loop that waits on GPUs the page-cache writeback of a large save (`checkpoint.direct_io`)."""
    if config is None and hasattr(model, "cfg"):  # enough for `megalite train` and the converter to use it
        config = {"model": dataclasses.asdict(model.cfg)}
    data_state = data_state or {"batch_index": step}
    named, buffers = model_state(model)
    problem, sched = None, None
    opt = optimizer_state(optimizer)
    try:  # everything a save could refuse, on every rank, before any rank writes
        check_model_state(named, opt.chunked())
        sched = encode_scheduler(scheduler)
        for field, value in (("client_state", client_state), ("data_state", data_state), ("config", config)):
            if value is not None and not isinstance(value, dict):
                raise CheckpointError(f"{field} is a {type(value).__name__}, expected a dict")
            bad = plain_problem(value, field)
            if bad:
                raise CheckpointError(bad)
        meta = step_meta(step, grid.layout, config, tokens_seen=tokens_seen, data=data_state,
                         client_state=client_state, scheduler=sched)
        check_meta(meta)
    except CheckpointError as e:
        problem = str(e)
    agreed(problem, grid, f"checkpoint step {step} was not saved")
    commit_groups(grid)  # the commit's own groups, made now by every rank in this (the main) thread
    section = opt.section(named, grid)  # with torch.optim, a collective that checks every rank's state
    pay = collect(named, opt, grid, StepState.capture(step, tokens_seen, data_state, sched), buffers=buffers)
    meta = dataclasses.replace(meta, zero1=opt.zero1, optimizer=section)
    if tokenizer is not None and grid.rank == 0:
        pay.step_files[TOKENIZER_FILE] = bytes(tokenizer)
    if origin is not None and grid.rank == 0:
        pay.step_files[ORIGIN_FILE] = bytes(origin)
    if saver is not None:
        saver.submit(Path(root), step, pay, grid, meta, keep_last, keep, optimizer, direct)
        return None
    return save_collective(Path(root), step, pay, grid, meta, keep_last, keep, direct)


def exchange_names(named, grid) -> Optional[set]:
    """Every name the whole model holds (the union over pipeline stages), for the unexpected-key check; the
    names of this rank alone when there is one stage. One all_gather_object over the pp axis: called first
    in load_checkpoint, before anything can fail, so every rank reaches it."""
    return {n for names in everyone([n for n, _ in named], grid, grid.pp) for n in names}


def load_checkpoint(path, model, optimizer, grid, *, scheduler=None, model_config: Optional[dict] = None) -> Loaded:
    """Load into this rank's slice (any layout; resharded on the fly). Raises CheckpointError if absent.
    All ranks call it (the pipeline stages exchange the names they hold first)."""
    named, _ = model_state(model)
    everywhere = exchange_names(named, grid)
    info = load_into(path, named, optimizer, grid, model_config, whole_model=everywhere)
    if scheduler is not None:
        if info.manifest.scheduler is None:
            info.warnings.append(f"WARNING: {info.path} holds no scheduler state: the scheduler starts fresh")
        else:
            scheduler.load_state_dict(decode(info.manifest.scheduler, f"{info.path}: scheduler", CheckpointError))
    return info
