"""Load a checkpoint into this rank's model slice and optimizer state, at the saved layout or any other.

Before anything is read, the manifest is parsed and validated (manifest.Manifest.from_json) and checked
against the run: model config (each differing field named with both values) and every tensor the model
needs (name and global shape). Every byte read is checked against its block CRC32 (reshard.SliceReader).
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from ..parallel.tensor import partition_of, tp_box, valid_view
from . import manifest as mf
from .layout import STATE_FILE, Box, CheckpointError, coord_dir, resolve
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
    manifest: mf.Manifest
    warnings: list = field(default_factory=list)  # for the caller's log (e.g. the optimizer starts fresh)


def check_model(man: mf.Manifest, step: Path, model_cfg: Optional[dict]) -> None:
    if model_cfg is None:
        return
    if not man.model_config:
        raise CheckpointError(f"{step}: manifest field 'config.model' is empty; cannot check it against this run")
    diffs = mf.model_config_diff(man.model_config, model_cfg)
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


def read_state(step: Path, man: mf.Manifest, coord) -> dict:
    """One coordinate's state.json, checked against the size and CRC32 the manifest records for it."""
    rel = f"{coord_dir(coord)}/{STATE_FILE}"
    path, rec = step / rel, man.files[rel]
    if path.is_symlink() or path.parent.is_symlink():
        raise CheckpointError(f"{step.name}: {rel} is a symbolic link (refused: files must live in the step folder)")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{step.name}: {rel} is missing") from None
    if len(data) != rec.bytes or f"{zlib.crc32(data):08x}" != rec.crc32:
        raise CheckpointError(f"{step.name}: {rel} fails its checksum ({len(data)} bytes, crc32 "
                              f"{zlib.crc32(data):08x}; the manifest says {rec.bytes} bytes, crc32 {rec.crc32})")
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
        plan.append((name, p, part, entry, Box(tp_box(part, c.tp, L.tp))))
    if optimizer is not None and not man.optimizer_state:
        optimizer = None  # a weights-only checkpoint (from `megalite split`): the optimizer starts fresh
        warnings.append(f"WARNING: {step} holds no optimizer state (weights only): AdamW moments start from "
                        f"zero and the optimizer step count from 0")
    moments = {}
    if optimizer is not None:
        for name, p, part, entry, box in plan:
            for moment in mf.MOMENTS:
                moments[name, moment] = entry_for(man.optimizer_state, f"{name}.{moment}", part.global_shape, step)
    state = read_state(step, man, c) if same and restore_rng_state else None
    with torch.no_grad():
        for name, p, part, entry, box in plan:
            _fill(valid_view(p.data, part, c.tp, L.tp), lambda out: reader.read(entry, box, out=out))
        if optimizer is not None:
            for name, p, part, entry, box in plan:
                a, b = optimizer.piece_of(name)
                for moment, store in (("exp_avg", optimizer.exp_avg), ("exp_avg_sq", optimizer.exp_avg_sq)):
                    target = store[name] if optimizer.zero1 else store[name].view(box.shape)
                    _fill(target, lambda out: reader.read(moments[name, moment], box,
                                                          flat=(a, b) if optimizer.zero1 else None, out=out))
            optimizer.step_count = int(man.optimizer["step"]) if man.optimizer else 0
    rng = False
    if state is not None and state.get("rng") is not None:  # None after split/reshard: no per-rank stream
        restore_rng(state["rng"])
        rng = True
    return Loaded(step, man.step, man.tokens_seen, man.data, man.client_state, same, rng, man, warnings)
