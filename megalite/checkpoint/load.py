"""Load a checkpoint into this rank's model slice and optimizer state, at the saved layout or any other.

Before anything is read, the manifest is parsed and validated (manifest.Manifest.from_json) and checked
against the run: model config (each differing field named with both values), every tensor the model needs
(name and global shape) and the optimizer's state (its owner's plan_load, optimizer.py). Every byte read is
checked against its block CRC32C (read.SliceReader).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from ..config import model_architecture
from ..base.errors import CheckpointError
from ..parallel.partition import partition_of, tp_box, valid_view
from .validate import read_state
from .manifest import Manifest, entry_for, read
from .optimizer import OptimizerState, optimizer_state
from .read import SliceReader, fill
from .tree import STATE_FILE, coord_dir, resolve


@dataclass
class Loaded:
    path: Path
    step: int
    tokens_seen: int
    data: dict  # sampler state
    client_state: dict
    same_layout: bool
    rng_restored: bool
    manifest: Manifest
    warnings: list = field(default_factory=list)  # for the caller's log (e.g. the optimizer starts fresh)


def check_model(man: Manifest, step: Path, model_cfg: Optional[dict]) -> None:
    if model_cfg is None:
        return
    if not man.model_config:
        raise CheckpointError(f"{step}: manifest field 'config.model' is empty; cannot check it against this run")
    # dropout is a training setting: fine-tuning a split checkpoint with another value is allowed
    diffs = model_config_diff(model_architecture(man.model_config), model_architecture(model_cfg))
    if diffs:
        raise CheckpointError(f"{step}: saved with a different model: {'; '.join(diffs)}")


def model_config_diff(saved: dict, current: dict) -> list[str]:
    """Differences in the [model] section, one 'field: checkpoint X, run Y' per field."""
    keys = sorted(set(saved) | set(current))
    return [f"model.{k}: checkpoint has {saved.get(k)!r}, this run has {current.get(k)!r}"
            for k in keys if saved.get(k) != current.get(k)]


def check_keys(man: Manifest, step: Path, mine: set, whole_model: Optional[set]) -> None:
    """torch's load_state_dict strictness: the keys this rank holds that the checkpoint lacks (missing), and
    the checkpoint's model keys that no rank's model holds (unexpected: `whole_model`, the union over the
    pipeline stages; None skips that half), all named in one line."""
    missing = sorted(mine - set(man.model))
    unexpected = sorted(set(man.model) - whole_model) if whole_model is not None else []
    if not missing and not unexpected:
        return
    def some(keys):
        return ", ".join(f"'{k}'" for k in keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
    parts = ([f"missing key(s) (the model has them, the checkpoint does not): {some(missing)}"] if missing else []) \
        + ([f"unexpected key(s) (the checkpoint has them, no rank's model does): {some(unexpected)}"]
           if unexpected else [])
    raise CheckpointError(f"{step}: the checkpoint does not match the model's state_dict: {'; '.join(parts)}")


def load_into(path, params, optimizer, grid, model_cfg: Optional[dict] = None,
              restore_rng_state: bool = True, whole_model: Optional[set] = None) -> Loaded:
    """Fill `params` ([(global name, tensor)]: parameters and buffers) and `optimizer` (megalite's
    ShardedAdamW, a torch.optim optimizer or None) from the checkpoint at `path`. `whole_model`: every
    name the model holds on any rank (api.exchange_names), for the unexpected-key check."""
    step = resolve(path)
    man = read(step)
    check_model(man, step, model_cfg)
    check_keys(man, step, {n for n, _ in params}, whole_model)
    c, L = grid.coord, grid.layout
    same = tuple(man.layout) == tuple(L)
    reader = SliceReader(step, man)
    warnings = []
    # Check every name and shape first, so a mismatch fails before any parameter has changed.
    plan = []
    for name, p in params:
        part = partition_of(p)
        entry = entry_for(man.model, name, part.global_shape, step)
        plan.append((name, p, part, entry, tp_box(part, c.tp, L.tp)))
    opt = optimizer_state(optimizer)
    opt.settle()  # an async save still writing from the optimizer's tensors finishes first
    if not opt.holds_state(man):  # a weights-only checkpoint (from `megalite split`): the optimizer starts fresh
        warnings.append(f"WARNING: {step} holds no optimizer state (weights only): {opt.fresh}")
        opt = OptimizerState()
    todo = opt.plan_load(man, step, plan)
    state = read_state(step, man, c) if same and restore_rng_state else None
    with reader, torch.no_grad():  # the reader's files closed when done, or on an error
        for name, p, part, entry, box in plan:
            fill(valid_view(p.data, part, c.tp, L.tp), lambda out: reader.read(entry, box, out=out))
        opt.load(reader, man, todo, grid)
    rng = state is not None and state.restore_rng(f"{step.name}: {coord_dir(c, L.cp)}/{STATE_FILE}")  # False: none
    return Loaded(step, man.step, man.tokens_seen, man.data, man.client_state, same, rng, man, warnings)
