"""Any torch.optim optimizer in a megalite checkpoint (AdamW, Adam with amsgrad, SGD with momentum, ...).

What is saved, and how it reshards:
  - every per-parameter state tensor (exp_avg, exp_avg_sq, max_exp_avg_sq, momentum_buffer) must have its
    parameter's shape; it is stored as the global tensor `<name>.optim.<key>`, cut into the same tp slices and
    written by the same rank as its parameter, so any layout can load it exactly as it loads the parameter;
  - scalar state (a 0-dim tensor such as AdamW's per-parameter `step`, or a Python number) and every param
    group's hyperparameters (lr, betas, weight_decay, ...) go in the manifest's `optimizer` section as JSON
    numbers (exact), gathered from all ranks, with the global names of each group's parameters.
Loading builds a torch state dict and hands it to the optimizer's own `load_state_dict`, so devices and dtypes
follow torch's rules and the hyperparameters come from the checkpoint, as torch does (set `lr` after loading
to change it). Anything else in the state (a tensor of another shape, a non-number) is refused at save time
with a one-line error naming the parameter and the key.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..parallel.partition import local_shape, partition_of, valid_view
from . import manifest as mf
from .tree import OPTIM_FILE, CheckpointError, WriteItem
from .save import add


def is_torch(optimizer) -> bool:
    return isinstance(optimizer, torch.optim.Optimizer)


def class_name(optimizer) -> str:
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def _json_hyper(v, at: str):
    if isinstance(v, tuple):
        v = list(v)
    if not mf._hyper_ok(v):
        raise CheckpointError(f"optimizer {at} is {type(v).__name__} {mf._short(v)}: only numbers, strings, "
                              f"booleans, None and lists of them are checkpointed")
    return v


def _scalar(v, at: str) -> dict:
    if torch.is_tensor(v):
        name = next((k for k, d in mf.SCALAR_DTYPES.items() if d == v.dtype), None)
        if name is None:
            raise CheckpointError(f"optimizer {at} is a 0-dim {v.dtype} tensor (expected one of "
                                  f"{', '.join(mf.SCALAR_DTYPES)})")
        return {"dtype": name, "value": v.item()}
    return {"value": v}


def _this_rank(named, optimizer, grid) -> dict:
    """This rank's param groups (by global name), scalar state and state tensors, checked."""
    names = {id(p): n for n, p in named}
    groups, scalars, tensors = [], {}, {}
    for k, g in enumerate(optimizer.param_groups):
        hyper = {key: _json_hyper(v, f"param_groups[{k}].{key}") for key, v in g.items()
                 if key not in ("params", "param_names")}
        bad = [key for key in hyper if not mf.STATE_KEY.match(key)]
        if bad:
            raise CheckpointError(f"optimizer param_groups[{k}] key {bad[0]!r} is not an identifier")
        members = []
        for p in g["params"]:
            name = names.get(id(p))
            if name is None:
                raise CheckpointError(f"optimizer param_groups[{k}] holds a tensor of shape {list(p.shape)} that is "
                                      f"not a parameter of the model passed to save_checkpoint")
            members.append(name)
            for key, v in optimizer.state.get(p, {}).items():
                at = f"state '{key}' of parameter '{name}'"
                if not isinstance(key, str) or not mf.STATE_KEY.match(key):
                    raise CheckpointError(f"optimizer state key {key!r} of parameter '{name}' is not an identifier")
                if torch.is_tensor(v) and v.dim() > 0:
                    if v.shape != p.shape:
                        raise CheckpointError(f"optimizer {at} has shape {list(v.shape)}, not the parameter's "
                                              f"{list(p.shape)} (only state tensors of their parameter's shape can "
                                              f"be checkpointed and resharded)")
                    if v.dtype not in mf.DTYPE_NAMES:
                        raise CheckpointError(f"optimizer {at} is {v.dtype} (expected one of {', '.join(mf.DTYPES)})")
                    tensors[name, key] = v
                elif torch.is_tensor(v) or (isinstance(v, (int, float)) and not isinstance(v, bool)):
                    scalars.setdefault(name, {})[key] = _scalar(v, at)
                else:
                    raise CheckpointError(f"optimizer {at} is a {type(v).__name__}: only tensors of the "
                                          f"parameter's shape and numbers are checkpointed")
        groups.append({"hyper": hyper, "params": members})
    return {"class": class_name(optimizer), "groups": groups, "scalars": scalars, "tensors": tensors}


def describe(named, optimizer, grid) -> tuple[dict, dict]:
    """(the manifest's optimizer section, {(name, key): this rank's state tensor}). The section is gathered
    from every rank (each pipeline stage knows only its own parameters), so every rank returns the same one;
    a problem on any rank is raised on every rank. Collective over the grid's `cpu` group."""
    try:
        mine, error = _this_rank(named, optimizer, grid), None
    except CheckpointError as e:
        mine, error = None, f"rank {grid.rank}: {e}"
    entry = (error, None if mine is None else {k: v for k, v in mine.items() if k != "tensors"})
    everyone = [entry]
    if grid.layout.world_size > 1:
        everyone = [None] * grid.layout.world_size
        dist.all_gather_object(everyone, entry, group=grid.cpu)
    errors = [e for e, _ in everyone if e]
    if errors:
        raise CheckpointError(errors[0])
    first = everyone[0][1]
    groups = [{"params": [], **g["hyper"]} for g in first["groups"]]
    listed = [set() for _ in groups]
    scalars = {}
    for r, (_, d) in enumerate(everyone):
        if d["class"] != first["class"] or len(d["groups"]) != len(groups):
            raise CheckpointError(f"rank {r} has a {d['class']} with {len(d['groups'])} param groups, rank 0 a "
                                  f"{first['class']} with {len(groups)}: every rank must build the same optimizer")
        for k, g in enumerate(d["groups"]):
            if g["hyper"] != first["groups"][k]["hyper"]:
                key = next(key for key in {**g["hyper"], **first["groups"][k]["hyper"]}
                           if g["hyper"].get(key) != first["groups"][k]["hyper"].get(key))
                raise CheckpointError(f"optimizer param_groups[{k}].{key} is {g['hyper'].get(key)!r} on rank {r} "
                                      f"but {first['groups'][k]['hyper'].get(key)!r} on rank 0")
            for n in g["params"]:  # in rank order, each name once (tp/dp replicas list it too)
                if n not in listed[k]:
                    listed[k].add(n)
                    groups[k]["params"].append(n)
        for name, s in d["scalars"].items():
            scalars.setdefault(name, s)  # tp/dp replicas hold the same values
    steps = [s["step"]["value"] for s in scalars.values() if "step" in s and math.isfinite(s["step"]["value"])]
    section = {"type": mf.TORCH_OPTIM, "class": first["class"], "step": int(max(steps, default=0)),
               "param_groups": groups, "scalars": scalars}
    return section, mine["tensors"]


def add_state(pay, tensors: dict, grid) -> None:
    """Put each state tensor next to its parameter in this rank's payload: a planned model slice brings the
    same slice of each of its parameter's state tensors (same box, same writer)."""
    c, L = grid.coord, grid.layout
    keys: dict = {}
    for name, key in tensors:
        keys.setdefault(name, []).append(key)
    for proto, it in [(p, i) for p, i in pay.records if i.kind == "model"]:
        part = proto.partition
        for key in sorted(keys.get(it.name, ())):
            t = valid_view(tensors[it.name, key].detach(), part, c.tp, L.tp)
            if it.flat:  # the planned piece of the box (the write plan cuts a stage's slice over dp)
                t = t.reshape(-1)[it.flat[0]:it.flat[1]]
            add(pay, WriteItem(it.name, f"optim.{key}", OPTIM_FILE, it.box, it.flat), part, t)


def plan_load(man: mf.Manifest, step, plan: list, optimizer) -> list:
    """Check the checkpoint's torch.optim state against `optimizer` before anything changes; returns what
    `load` reads: [(group index, param, name, partition, box, [(key, entry)], scalars)]."""
    sec = man.optimizer
    if sec is None or sec.get("type") != mf.TORCH_OPTIM:
        what = "no optimizer state" if sec is None else f"megalite's own AdamW state (optimizer.type {sec.get('type')!r})"
        raise CheckpointError(f"{step.name} holds {what}, not a torch.optim optimizer's; pass optimizer=None "
                              f"to load the weights only and start {class_name(optimizer)} fresh")
    if sec["class"] != class_name(optimizer):
        raise CheckpointError(f"{step.name}: optimizer.class is {sec['class']}, this optimizer is "
                              f"{class_name(optimizer)}; pass optimizer=None to load the weights only")
    saved = sec["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(f"{step.name}: the checkpoint's optimizer has {len(saved)} param groups, this one "
                              f"{len(optimizer.param_groups)}")
    group_of = {n: k for k, g in enumerate(saved) for n in g["params"]}
    by_param: dict = {}
    for e in man.optimizer_state.values():
        by_param.setdefault(e.name[:-len(e.kind) - 1], []).append((e.kind[len("optim."):], e))
    where = {id(p): (name, part, box) for name, p, part, _, box in plan}
    out = []
    for k, g in enumerate(optimizer.param_groups):
        for p in g["params"]:
            if id(p) not in where:
                raise CheckpointError(f"optimizer param_groups[{k}] holds a tensor of shape {list(p.shape)} that is "
                                      f"not a parameter of the model passed to load_checkpoint")
            name, part, box = where[id(p)]
            if group_of.get(name) != k:
                other = "no group" if name not in group_of else f"param_groups[{group_of[name]}]"
                raise CheckpointError(f"{step.name}: parameter '{name}' is in param_groups[{k}] here but in "
                                      f"{other} in the checkpoint")
            out.append((k, p, name, part, box, sorted(by_param.get(name, [])), sec["scalars"].get(name, {})))
    return out


def load(reader, man: mf.Manifest, todo: list, optimizer, grid) -> None:
    """Read every state tensor (this rank's slice of it) and scalar, and hand them to optimizer.load_state_dict
    together with the checkpoint's hyperparameters (keys the checkpoint lacks keep the constructor's values)."""
    c, L = grid.coord, grid.layout
    state = {}
    for i, (_, p, name, part, box, entries, scalars) in enumerate(todo):
        s = {}
        for key, entry in entries:
            full = torch.zeros(local_shape(part, L.tp), dtype=entry.torch_dtype)
            view = valid_view(full, part, c.tp, L.tp)
            got = reader.read(entry, box, out=view if view.is_contiguous() else None)
            if got.data_ptr() != view.data_ptr():
                view.copy_(got.view(view.shape))
            s[key] = full
        for key, rec in scalars.items():
            dt = rec.get("dtype")
            s[key] = rec["value"] if dt is None else torch.tensor(rec["value"], dtype=mf.SCALAR_DTYPES[dt])
        if s:
            state[i] = s
    groups, i = [], 0
    for k, g in enumerate(optimizer.param_groups):
        hyper = {key: (tuple(v) if isinstance(g.get(key), tuple) else v)
                 for key, v in man.optimizer["param_groups"][k].items() if key != "params"}
        kept = {key: v for key, v in g.items() if key != "params"}
        groups.append({**kept, **hyper, "params": list(range(i, i + len(g["params"])))})
        i += len(g["params"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})
