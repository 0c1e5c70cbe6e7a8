"""Load a checkpoint into this rank's model slice and optimizer state, at the saved layout or any other.

Before anything is read, the manifest is parsed and validated (manifest.Manifest.from_json) and checked
against the run: model config (each differing field named with both values) and every tensor the model
needs (name and global shape). Every byte read is checked against its block CRC32C (reshard.SliceReader).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from ..config import model_architecture
from ..parallel.partition import partition_of, tp_box, valid_view
from . import manifest as mf
from . import torch_optim
from .tree import STATE_FILE, TOKENIZER_REL, CheckpointError, coord_dir, resolve
from .read import SliceReader
from .state import restore_rng
from .stream import crc32c


@dataclass
class Loaded:
    path: Path
    step: int
    tokens_seen: int
    data: dict  # sampler state
    client_state: dict
    same_layout: bool
    rng_restored: bool
    manifest: mf.Manifest
    warnings: list = field(default_factory=list)  # for the caller's log (e.g. the optimizer starts fresh)


def check_model(man: mf.Manifest, step: Path, model_cfg: Optional[dict]) -> None:
    if model_cfg is None:
        return
    if not man.model_config:
        raise CheckpointError(f"{step}: manifest field 'config.model' is empty; cannot check it against this run")
    # dropout is a training setting: fine-tuning a split checkpoint with another value is allowed
    diffs = mf.model_config_diff(model_architecture(man.model_config), model_architecture(model_cfg))
    if diffs:
        raise CheckpointError(f"{step}: saved with a different model: {'; '.join(diffs)}")


def entry_for(section: dict, name: str, shape, step: Path) -> mf.TensorEntry:
    """The manifest's entry for a tensor the caller needs, with the global shape it expects."""
    entry = section.get(name)
    if entry is None:
        raise CheckpointError(f"{step}: tensor '{name}' is missing from the manifest")
    if list(entry.shape) != list(shape):
        raise CheckpointError(f"{step}: tensor '{name}' has global shape {list(entry.shape)} in the manifest, "
                              f"the model expects {list(shape)}")
    return entry


def _read_listed(step: Path, man: mf.Manifest, rel: str) -> bytes:
    """A JSON file the manifest lists, checked against the size and CRC32C it records."""
    path, rec = step / rel, man.files[rel]
    if path.is_symlink() or path.parent.is_symlink():
        raise CheckpointError(f"{step.name}: {rel} is a symbolic link (refused: files must live in the step folder)")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{step.name}: {rel} is missing") from None
    if len(data) != rec.bytes or f"{crc32c(data):08x}" != rec.crc32c:
        raise CheckpointError(f"{step.name}: {rel} fails its checksum ({len(data)} bytes, crc32c "
                              f"{crc32c(data):08x}; the manifest says {rec.bytes} bytes, crc32c {rec.crc32c})")
    return data


def read_tokenizer(step: Path, man: mf.Manifest) -> Optional[bytes]:
    """The run's tokenizer.json, checked; None for a checkpoint saved without one (older, or the API's)."""
    return _read_listed(step, man, TOKENIZER_REL) if TOKENIZER_REL in man.files else None


def read_state(step: Path, man: mf.Manifest, coord) -> dict:
    """One coordinate's state.json, checked against the size and CRC32C the manifest records for it."""
    rel = f"{coord_dir(coord)}/{STATE_FILE}"
    data = _read_listed(step, man, rel)
    try:
        state = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{step.name}: {rel} is not valid JSON ({e})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{step.name}: {rel} is not a JSON object")
    return state


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
    torch_opt = torch_optim.is_torch(optimizer)  # any torch.optim optimizer; else megalite's ShardedAdamW
    if hasattr(optimizer, "settle"):  # an async save still writing from these tensors finishes first
        optimizer.settle()
    if optimizer is not None and (man.optimizer is None if torch_opt else not man.optimizer_state):
        optimizer = None  # a weights-only checkpoint (from `megalite split`): the optimizer starts fresh
        warnings.append(f"WARNING: {step} holds no optimizer state (weights only): " + (
            "the optimizer starts fresh" if torch_opt else "AdamW moments start from zero and the optimizer step "
                                                            "count from 0"))
    moments, todo = {}, None
    if optimizer is not None and torch_opt:
        todo = torch_optim.plan_load(man, step, plan, optimizer)
    elif optimizer is not None:
        if man.optimizer and man.optimizer.get("type") == mf.TORCH_OPTIM:
            raise CheckpointError(f"{step.name} holds the state of a torch.optim optimizer "
                                  f"({man.optimizer['class']}), not of megalite's AdamW; pass optimizer=None to "
                                  f"load the weights only")
        for name, p, part, entry, box in plan:
            for moment in mf.MOMENTS:
                moments[name, moment] = entry_for(man.optimizer_state, f"{name}.{moment}", part.global_shape, step)
    state = read_state(step, man, c) if same and restore_rng_state else None
    with torch.no_grad():
        for name, p, part, entry, box in plan:
            _fill(valid_view(p.data, part, c.tp, L.tp), lambda out: reader.read(entry, box, out=out))
        if optimizer is not None and not torch_opt:
            for name, p, part, entry, box in plan:
                a, b = optimizer.piece_of(name)
                for moment, store in (("exp_avg", optimizer.exp_avg), ("exp_avg_sq", optimizer.exp_avg_sq)):
                    target = store[name] if optimizer.zero1 else store[name].view(box.shape)
                    _fill(target, lambda out: reader.read(moments[name, moment], box,
                                                          flat=(a, b) if optimizer.zero1 else None, out=out))
            optimizer.step_count = int(man.optimizer["step"]) if man.optimizer else 0
    if todo is not None:
        torch_optim.load(reader, man, todo, optimizer, grid)
    rng = False
    if state is not None and state.get("rng") is not None:  # None after split/reshard: no per-rank stream
        try:
            restore_rng(state["rng"])
        except (KeyError, TypeError, ValueError, IndexError, OverflowError, RuntimeError) as e:
            raise CheckpointError(f"{step.name}: {coord_dir(c)}/{STATE_FILE} has an unusable 'rng' state "
                                  f"({type(e).__name__}: {e})") from None
        rng = True
    return Loaded(step, man.step, man.tokens_seen, man.data, man.client_state, same, rng, man, warnings)
