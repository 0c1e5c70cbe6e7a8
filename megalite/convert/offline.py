"""Writing a whole checkpoint in one process: one model file -> any layout (split), and layout -> layout
(reshard)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Optional

from ..checkpoint import manifest as mf
from ..checkpoint.layout import CheckpointError, coord_dir, plan_writes, remove_tree, resolve, step_dir, tmp_dir
from ..checkpoint.reshard import SliceReader
from ..checkpoint.save import Payload, add, commit_step, manifest_meta, write_rank
from ..config import Config
from ..parallel.grid import Layout
from ..parallel.pipeline import stage_of
from ..parallel.tensor import Partition
from .common import ConvertError, Progress, _check_out, _model_cfg, _replace, check_layout, check_manifest_tensors, \
    model_partitions
from .single import read_model_file


def _nbytes(it) -> int:
    n = it.flat[1] - it.flat[0] if it.flat else math.prod(b - a for a, b in it.box)
    return n * 4


def _write_checkpoint(out: Path, step: int, layout: Layout, zero1: bool, tensors: dict[str, Partition],
                      n_layer: int, read: Callable, meta: dict, with_optimizer: bool, what: str, quiet: bool,
                      coord_state: Callable) -> Path:
    """Write every coordinate of `layout` in this one process into a temporary root next to `out`, commit it
    like a live save, then move it into place; on any failure nothing is left behind."""
    root = out.with_name(out.name + ".tmp-megalite")
    remove_tree(root)
    tmp = root / tmp_dir(step)
    tmp.mkdir(parents=True)
    plans = []
    for c in layout.coords():
        stage = [(n, p) for n, p in tensors.items() if stage_of(p.placement, n_layer, layout.pp) == c.pp]
        plans.append((c, plan_writes(stage, c, layout, zero1, optimizer=with_optimizer)))
    items = [it for _, plan in plans for it in plan]
    progress = Progress(what, len(items), sum(_nbytes(it) for it in items), quiet)
    reports = []
    try:
        for c, plan in plans:
            pay = Payload(files={}, state=coord_state(c))
            for it in plan:
                add(pay, it, tensors[it.name], read(it))
                progress.step(_nbytes(it))
            reports.append(write_rank(tmp / coord_dir(c), pay, coord_dir(c)))
        commit_step(root, step, mf.build(meta, reports))
    except BaseException:
        remove_tree(root)
        raise
    _replace(root, out)
    return out / step_dir(step)


def split(model, out, tp: int, pp: int, dp: int, zero1: bool = False, step: int = 0, force: bool = False,
          quiet: bool = False) -> Path:
    """One model file (megalite or HF GPT-2) -> a committed checkpoint at (tp, pp, dp), fresh optimizer."""
    m, get, names = read_model_file(model)
    check_layout(m, tp, pp, dp)
    out = Path(out)
    _check_out(out, force, [Path(model)])
    parts = model_partitions(m)
    missing = sorted(set(parts) - set(names))
    if missing:
        raise ConvertError(f"{model}: tensor '{missing[0]}' is missing ({len(missing)} of {len(parts)} missing)")
    cache: dict = {}

    def read(it):
        if it.name not in cache:
            cache.clear()
            full = get(it.name)
            if list(full.shape) != list(parts[it.name].global_shape):
                raise ConvertError(f"{model}: tensor '{it.name}' has shape {list(full.shape)}, "
                                   f"expected {list(parts[it.name].global_shape)}")
            cache[it.name] = full
        return cache[it.name][tuple(slice(a, b) for a, b in it.box)].clone()

    cfg = Config.from_dict({"model": m, "parallel": {"tp": tp, "pp": pp, "dp": dp, "zero1": zero1}}).to_dict()
    meta = manifest_meta(cfg, Layout(tp, pp, dp), zero1, step, 0, None, {"batch_index": step}, None)
    return _write_checkpoint(out, step, Layout(tp, pp, dp), zero1, parts, m["n_layer"], read, meta, False,
                             "split", quiet,
                             lambda c: {"step": step, "tokens_seen": 0, "rng": None, "data": {"batch_index": step}})


def reshard(ckpt, out, tp: int, pp: int, dp: int, zero1: Optional[bool] = None, force: bool = False,
            quiet: bool = False) -> Path:
    """The full training state of a checkpoint (model, moments, step, data position) at a new layout.

    Per-rank RNG states are not carried over: a coordinate of the new layout has no counterpart in the
    old one, so resuming re-seeds every rank from (seed, step), as resuming at another layout does.
    """
    src = resolve(ckpt)
    man = mf.read(src)
    m = _model_cfg(man)
    check_layout(m, tp, pp, dp)
    check_manifest_tensors(src, man)
    zero1 = man["layout"].get("zero1", False) if zero1 is None else zero1
    out = Path(out)
    _check_out(out, force, [src.parent, src])
    parts = {n: Partition.from_json(e["shape"], e["partition"]) for n, e in man["model"].items()}
    reader = SliceReader(src, man)
    with_opt = bool(man["optimizer_state"])

    def read(it):
        if it.kind == "model":
            return reader.read(it.name, man["model"][it.name], it.box)
        entry = man["optimizer_state"].get(it.key)
        if entry is None:
            raise CheckpointError(f"{src.name}: tensor '{it.key}' is missing from the manifest")
        t = reader.read(it.key, entry, it.box, flat=it.flat)
        return t if it.flat else t.view([b - a for a, b in it.box])

    cfg = json.loads(json.dumps(man["config"]))
    cfg.setdefault("parallel", {}).update({"tp": tp, "pp": pp, "dp": dp, "zero1": zero1})
    meta = {k: v for k, v in man.items() if k not in ("model", "optimizer_state", "files", "format",
                                                       "format_version")}
    meta.update(config=cfg, layout={"tp": tp, "pp": pp, "dp": dp, "zero1": zero1},
                resharded_from={"layout": man["layout"], "path": str(src)})
    return _write_checkpoint(out, man["step"], Layout(tp, pp, dp), zero1, parts, m["n_layer"], read, meta,
                             with_opt, "reshard", quiet,
                             lambda c: {"step": man["step"], "tokens_seen": man.get("tokens_seen", 0), "rng": None,
                                        "data": man.get("data") or {}})
