"""Writing a whole checkpoint in one process: one model file -> any layout (split), and layout -> layout
(reshard). Both go through `write_offline`, which plans with the live save's `plan_writes`, writes each
coordinate with its `write_rank` and commits with its `commit_step`: one tree, one protocol, one meta
(`step_meta`) and one state.json (`StepState`)."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable, Optional

import torch

from ..checkpoint import manifest as mf
from ..checkpoint.validate import read_origin, read_tokenizer
from ..checkpoint.commit import commit_step, write_rank
from ..base.fs import remove_tree, replace_output
from ..checkpoint.plan import Payload, add, plan_writes
from ..checkpoint.read import SliceReader
from ..checkpoint.state import StepState
from ..checkpoint.tree import ORIGIN_FILE, TOKENIZER_FILE, coord_dir, resolve, step_dir, tmp_dir
from ..config import MAX_COUNT, Config
from ..parallel.grid import Layout
from ..parallel.pipeline import stage_of
from ..parallel.partition import Partition
from .common import ConvertError, Progress, check_layout, check_manifest_tensors, check_out, model_partitions
from . import check as checking
from .sources import FileSource, StepSource, open_source


def write_offline(out: Path, layout: Layout, tensors: dict[str, Partition], n_layer: int, read: Callable,
                  meta: mf.StepMeta, with_optimizer: bool, what: str, quiet: bool, itemsize: Callable,
                  step_files: Optional[dict] = None) -> Path:
    """Write every coordinate of `layout` in this one process into a temporary root next to `out`, commit it
    as a live save does (commit_step), then move it into place; on any failure nothing is left behind.
    Every coordinate's state.json is the step's, without RNG states (no coordinate has a stream of its own).

    read(item) -> the tensor of one planned slice (checked by the reader); itemsize(item) -> its bytes per
    element (progress only); step_files: {name: bytes} the checkpoint carries beside coordinate 0's shards (its
    tokenizer.json, origin.json)."""
    step = meta.step
    root = out.with_name(out.name + ".tmp-megalite")
    remove_tree(root)
    tmp = root / tmp_dir(step)
    tmp.mkdir(parents=True)
    plans = []
    for c in layout.coords():
        stage = [(n, p) for n, p in tensors.items() if stage_of(p.placement, n_layer, layout.pp) == c.pp]
        plans.append((c, plan_writes(stage, c, layout, optimizer=with_optimizer)))
    items = [it for _, plan in plans for it in plan]

    def nbytes(it):
        return (it.flat[1] - it.flat[0] if it.flat else it.box.numel) * itemsize(it)

    progress = Progress(what, len(items), sum(nbytes(it) for it in items), quiet)
    state = StepState(step, meta.tokens_seen, meta.data, rng=None, scheduler=meta.scheduler)
    try:
        reports = []
        for c, plan in plans:
            pay = Payload(files={}, state=state)
            if not reports:
                pay.step_files.update({k: v for k, v in (step_files or {}).items() if v is not None})
            for it in plan:
                add(pay, it, tensors[it.name], read(it))
                progress.step(nbytes(it))
            rel = coord_dir(c, layout.cp)
            reports.append(write_rank(tmp / rel, pay, rel))
        commit_step(root, step, meta, reports)
    except BaseException:
        remove_tree(root)
        raise
    replace_output(root, out)
    return out / step_dir(step)


def split(model, out, tp: int, pp: int, dp: int, zero1: bool = False, step: int = 0, force: bool = False,
          quiet: bool = False, cp: int = 1, check: Optional[bool] = None) -> Path:
    """Any source that names a model (a megalite file or checkpoint, a transformers folder, a Megatron
    checkpoint) -> a committed checkpoint at (tp, pp, dp, cp), fresh optimizer. check: the self-check `convert`
    runs on an import (None: on for a source from elsewhere where transformers is installed): megalite's model
    on the source's tensors against the source's own forward, before anything is written."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_COUNT:
        raise ConvertError(f"--step {step}: expected an integer >= 0 and <= {MAX_COUNT} (the step the checkpoint "
                           f"says it is at)")
    src = open_source(Path(model))
    if src.model is None:
        raise ConvertError(f"{model}: a plain DCP checkpoint does not say what model its tensors make")
    m = src.model
    layout = check_layout(m, tp, pp, dp, cp)
    out = Path(out)
    check_out(out, force, src.guards, "checkpoint")
    parts = model_partitions(m)
    missing = sorted(set(parts) - set(src.specs))
    if missing:
        raise ConvertError(f"{model}: tensor '{missing[0]}' is missing ({len(missing)} of {len(parts)} missing)")
    if check is None:
        check = not isinstance(src, (StepSource, FileSource)) and checking.available()
    if check:
        checking.check(src, lambda: checking.megalite_runner(src), torch.float32,
                       "megalite's model on the source's tensors", quiet)
    cache: dict = {}

    def read(it):
        if it.name not in cache:
            cache.clear()
            full = src.read(it.name).float()
            if list(full.shape) != list(parts[it.name].global_shape):
                raise ConvertError(f"{model}: tensor '{it.name}' has shape {list(full.shape)}, "
                                   f"expected {list(parts[it.name].global_shape)}")
            cache[it.name] = full
        t = cache[it.name][it.box.index]
        return t.reshape(-1)[it.flat[0]:it.flat[1]].clone() if it.flat else t.clone()

    cfg = Config.from_dict({"model": m, "parallel": {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "zero1": zero1}}).to_dict()
    meta = mf.step_meta(step, layout, cfg, data={"batch_index": step}, zero1=zero1)
    tok, origin = src.tokenizer(), src.origin()  # an HF folder's own (GPT-2's vocab.json + merges.txt too)...
    return write_offline(out, layout, parts, m["n_layer"], read, meta, False, "split", quiet, lambda it: 4,
                         {TOKENIZER_FILE: None if tok is None else tok.json.encode(),
                          ORIGIN_FILE: None if origin is None else origin.to_json().encode()})


def reshard(ckpt, out, tp: int, pp: int, dp: int, zero1: Optional[bool] = None, force: bool = False,
            quiet: bool = False, cp: int = 1) -> Path:
    """The full training state of a checkpoint (model, moments, step, data position) at a new layout.

    Every byte taken from the source is checked against its block checksum as it is read, so a damaged
    source is refused (nothing is written) instead of being re-checksummed into a clean-looking copy.
    Per-rank RNG states are not carried over: a coordinate of the new layout has no counterpart in the
    old one, so resuming re-seeds every rank from (seed, step), as resuming at another layout does.
    """
    src = resolve(ckpt)
    man = mf.read(src)
    m = man.model_config
    layout = check_layout(m, tp, pp, dp, cp)
    check_manifest_tensors(src, man)
    zero1 = man.zero1 if zero1 is None else zero1
    out = Path(out)
    check_out(out, force, [src.parent, src], "checkpoint")
    reader = SliceReader(src, man)
    with_opt = bool(man.optimizer_state)
    if with_opt:
        for name in man.model:
            for moment in mf.MOMENTS:
                if f"{name}.{moment}" not in man.optimizer_state:
                    raise ConvertError(f"{src.name}: tensor '{name}.{moment}' is missing from the manifest")

    def entry(it):
        return man.model[it.name] if it.kind == "model" else man.optimizer_state[it.key]

    def read(it):
        t = reader.read(entry(it), it.box, flat=it.flat)
        return t if it.flat else t.view(it.box.shape)

    cfg = copy.deepcopy(man.config)
    cfg.setdefault("parallel", {}).update({"tp": tp, "pp": pp, "dp": dp, "cp": cp, "zero1": zero1})
    source = {"layout": {"tp": man.layout.tp, "pp": man.layout.pp, "dp": man.layout.dp, "zero1": man.zero1,
                         **({"cp": man.layout.cp} if man.layout.cp != 1 else {})}, "path": str(src)}
    meta = mf.step_meta(man.step, layout, cfg, tokens_seen=man.tokens_seen, data=man.data, zero1=zero1,
                        optimizer=man.optimizer, client_state=man.client_state, scheduler=man.scheduler,
                        info={**man.info, "resharded_from": source})
    parts = {n: e.partition for n, e in man.model.items()}
    origin = read_origin(src, man)
    return write_offline(out, layout, parts, m["n_layer"], read, meta, with_opt, "reshard", quiet,
                         lambda it: entry(it).itemsize, {TOKENIZER_FILE: read_tokenizer(src, man),
                                                         ORIGIN_FILE: origin and origin.to_json().encode()})
