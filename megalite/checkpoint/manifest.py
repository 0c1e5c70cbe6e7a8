"""The manifest: the global description of one checkpoint, enough to convert or reshard without model code.

    {
      "format": "megalite-checkpoint", "format_version": 1,
      "megalite_version": "...", "torch_version": "...", "created": "<ISO time>",
      "step": 200, "tokens_seen": 204800,
      "layout": {"tp": 2, "pp": 2, "dp": 2, "zero1": true},
      "config": { the full run config },
      "data": {"batch_index": 200},
      "optimizer": {"type": "adamw", "step": 200, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
      "model":     { "<global name>": TENSOR, ... },        e.g. "blocks.7.attn.qkv.weight"
      "optimizer_state": { "<global name>.exp_avg": TENSOR, "<global name>.exp_avg_sq": TENSOR, ... },
      "files": { "tp00-pp00-dp00/model.safetensors": {"bytes": 123, "crc32": "89abcdef"}, ... }
    }
    TENSOR = {"shape": [global shape], "dtype": "float32",
              "partition": {"dim": split dim over tp or null, "tied_to": null,
                            "placement": "first" | "last" | "layer.<i>"  (which pipeline stage owns it)},
              "slices": [{"file": "...", "key": "<key in that file>", "crc32": "<of the tensor's bytes>",
                          "box": [[start, end] per dim of the global tensor],
                          "flat": [a, b]    only for ZeRO-1 pieces: elements [a, b) of the box, row-major}]}
"""
from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

from .layout import MANIFEST, CheckpointError

FORMAT = "megalite-checkpoint"
FORMAT_VERSION = 1


def crc32_bytes(data, crc: int = 0) -> int:
    return zlib.crc32(data, crc)


def crc32_file(path: Path, chunk: int = 16 << 20) -> str:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def build(meta: dict, reports: list[dict]) -> dict:
    """Merge every rank's report (the files it wrote, the slices they hold) into one manifest."""
    man = {"format": FORMAT, "format_version": FORMAT_VERSION, **meta,
           "model": {}, "optimizer_state": {}, "files": {}}
    for rep in reports:
        man["files"].update(rep["files"])
        for t in rep["tensors"]:
            section = man["model"] if t["kind"] == "model" else man["optimizer_state"]
            entry = section.setdefault(t["name"], {"shape": t["shape"], "dtype": t["dtype"],
                                                   "partition": t["partition"], "slices": []})
            sl = {"file": t["file"], "key": t["key"], "box": t["box"], "crc32": t["crc32"]}
            if t.get("flat") is not None:
                sl["flat"] = t["flat"]
            entry["slices"].append(sl)
    for section in ("model", "optimizer_state"):
        man[section] = dict(sorted(man[section].items()))
        for entry in man[section].values():
            entry["slices"].sort(key=lambda s: (s["box"], s.get("flat") or [0, 0]))
    man["files"] = dict(sorted(man["files"].items()))
    return man


def read(step_dir: Path) -> dict:
    """Load and sanity-check manifest.json; refuse newer formats, naming both versions."""
    path = Path(step_dir) / MANIFEST
    try:
        man = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: manifest is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: manifest is not valid JSON ({e})") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        raise CheckpointError(f"{path}: field 'format' is {man.get('format') if isinstance(man, dict) else man!r}, "
                              f"expected '{FORMAT}'")
    version = man.get("format_version")
    if not isinstance(version, int):
        raise CheckpointError(f"{path}: field 'format_version' is {version!r}, expected an integer")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {version} is newer than this megalite reads "
                              f"(format_version {FORMAT_VERSION}); upgrade megalite")
    for key in ("layout", "config", "model", "optimizer_state", "files", "step"):
        if key not in man:
            raise CheckpointError(f"{path}: field '{key}' is missing")
    return man


def write(step_dir: Path, man: dict) -> None:
    import os
    path = Path(step_dir) / MANIFEST
    with open(path, "w") as f:
        json.dump(man, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def numel(box) -> int:
    return math.prod(b - a for a, b in box)


def tiling_problems(name: str, entry: dict) -> list[str]:
    """The slices of one tensor must cover its global shape exactly: no gap, no overlap."""
    shape = entry["shape"]
    boxes: dict = {}
    for s in entry["slices"]:
        box = tuple(tuple(r) for r in s["box"])
        if len(box) != len(shape) or any(not (0 <= a <= b <= n) for (a, b), n in zip(box, shape)):
            return [f"tensor '{name}': slice {s['box']} in {s['file']} lies outside shape {shape}"]
        boxes.setdefault(box, []).append(s.get("flat"))
    problems = []
    for box, flats in boxes.items():
        if None in flats:
            if len(flats) > 1:
                problems.append(f"tensor '{name}': box {list(map(list, box))} is stored more than once")
            continue
        spans = sorted(flats)
        pos = 0
        for a, b in spans:
            if a != pos:
                problems.append(f"tensor '{name}': pieces of box {list(map(list, box))} "
                                f"{'overlap' if a < pos else 'leave a gap'} at element {min(a, pos)}")
                break
            pos = b
        else:
            if pos != numel(box):
                problems.append(f"tensor '{name}': pieces of box {list(map(list, box))} end at {pos}, "
                                f"expected {numel(box)}")
    keys = list(boxes)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            if all(max(x[0], y[0]) < min(x[1], y[1]) for x, y in zip(a, b)):
                problems.append(f"tensor '{name}': slices {list(map(list, a))} and {list(map(list, b))} overlap")
    covered = sum(numel(b) for b in keys)
    if not problems and covered != math.prod(shape):
        problems.append(f"tensor '{name}': slices cover {covered} of {math.prod(shape)} elements (a gap)")
    return problems


def model_config_diff(saved: dict, current: dict) -> list[str]:
    """Differences in the [model] section, one 'field: checkpoint X, run Y' per field."""
    keys = sorted(set(saved) | set(current))
    return [f"model.{k}: checkpoint has {saved.get(k)!r}, this run has {current.get(k)!r}"
            for k in keys if saved.get(k) != current.get(k)]
