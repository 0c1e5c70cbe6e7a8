"""Load a checkpoint into this rank's model slice and optimizer state, at the saved layout or any other.

Before anything is read, the manifest is checked against the run: format version, model config (each
differing field named with both values), and every tensor the model needs (name and global shape).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..config import model_architecture
from ..parallel.tensor import partition_of, tp_box, valid_view
from . import manifest as mf
from .layout import STATE_FILE, CheckpointError, coord_dir, resolve
from .reshard import SliceReader
from .state import restore_rng


@dataclass
class Loaded:
    path: Path
    step: int
    tokens_seen: int
    data: dict  # sampler state
    client_state: dict
    same_layout: bool
    rng_restored: bool
    manifest: dict


def check_model(man: dict, step: Path, model_cfg: Optional[dict]) -> None:
    if model_cfg is None:
        return
    if not man["config"].get("model"):
        raise CheckpointError(f"{step}: manifest field 'config.model' is empty; cannot check it against this run")
    # dropout is a training setting: fine-tuning a split checkpoint with another value is allowed
    diffs = mf.model_config_diff(model_architecture(man["config"]["model"]), model_architecture(model_cfg))
    if diffs:
        raise CheckpointError(f"{step}: saved with a different model: {'; '.join(diffs)}")


def _entry(section: dict, name: str, shape, step: Path) -> dict:
    entry = section.get(name)
    if entry is None:
        raise CheckpointError(f"{step}: tensor '{name}' is missing from the manifest")
    if list(entry["shape"]) != list(shape):
        raise CheckpointError(f"{step}: tensor '{name}' has global shape {entry['shape']} in the manifest, "
                              f"the model expects {list(shape)}")
    return entry


def _fill(target: torch.Tensor, read) -> None:
    """Let the reader write straight into `target` when it is host memory; copy otherwise."""
    direct = target.device.type == "cpu" and target.is_contiguous()
    got = read(target if direct else None)
    if got is not target:
        target.copy_(got.reshape(target.shape))


def load_into(path, params, optimizer, grid, model_cfg: Optional[dict] = None,
              restore_rng_state: bool = True) -> Loaded:
    """Fill `params` ([(global name, parameter)]) and `optimizer` (or None) from the checkpoint at `path`."""
    step = resolve(path)
    man = mf.read(step)
    check_model(man, step, model_cfg)
    lay = man["layout"]
    c, L = grid.coord, grid.layout
    same = (lay["tp"], lay["pp"], lay["dp"]) == (L.tp, L.pp, L.dp)
    reader = SliceReader(step, man)
    # Check every name and shape first, so a mismatch fails before any parameter has changed.
    plan = []
    for name, p in params:
        part = partition_of(p)
        entry = _entry(man["model"], name, part.global_shape, step)
        box = [list(r) for r in tp_box(part, c.tp, L.tp)]
        plan.append((name, p, part, entry, box))
    if optimizer is not None and not man["optimizer_state"]:
        optimizer = None  # a weights-only checkpoint (from `megalite split`): the optimizer starts fresh
    if optimizer is not None:
        for name, p, part, entry, box in plan:
            for moment in ("exp_avg", "exp_avg_sq"):
                _entry(man["optimizer_state"], f"{name}.{moment}", part.global_shape, step)
    with torch.no_grad():
        for name, p, part, entry, box in plan:
            _fill(valid_view(p.data, part, c.tp, L.tp), lambda out: reader.read(name, entry, box, out=out))
        if optimizer is not None:
            for name, p, part, entry, box in plan:
                a, b = optimizer.piece_of(name)
                for moment, store in (("exp_avg", optimizer.exp_avg), ("exp_avg_sq", optimizer.exp_avg_sq)):
                    key = f"{name}.{moment}"
                    target = store[name] if optimizer.zero1 else store[name].view([hi - lo for lo, hi in box])
                    _fill(target, lambda out: reader.read(key, man["optimizer_state"][key], box,
                                                          flat=(a, b) if optimizer.zero1 else None, out=out))
            optimizer.step_count = int(man["optimizer"]["step"]) if man.get("optimizer") else 0
    rng = False
    if same and restore_rng_state:
        state_file = step / coord_dir(c) / STATE_FILE
        try:
            state = json.loads(state_file.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{step.name}: {coord_dir(c)}/{STATE_FILE} is missing") from None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{step.name}: {coord_dir(c)}/{STATE_FILE} is not valid JSON ({e})") from None
        if state.get("rng") is not None:  # None after split/reshard: no per-rank stream to restore
            restore_rng(state["rng"])
            rng = True
    return Loaded(step, int(man["step"]), int(man.get("tokens_seen", 0)), man.get("data") or {},
                  man.get("client_state") or {}, same, rng, man)
