"""The optimizer section of a checkpoint: one owner per kind of optimizer, behind one interface.

`optimizer_state(optimizer)` chooses the owner once (megalite's ShardedAdamW, any torch.optim optimizer, or
None); saving, loading and the payload then ask it, never the optimizer's type:

    section(named, grid)                 the manifest's `optimizer` field (collective for torch.optim)
    slices(named, model_slices, grid)    this rank's state tensors, one per planned model slice and kind
    holds_state(man) / fresh             whether a checkpoint has state for it; the warning when it has not
    plan_load(man, step, plan)           every check, before anything changes; returns what `load` reads
    load(reader, man, todo, grid)        fill the optimizer

megalite's AdamW (ZeRO-1 or not): the moments `<name>.exp_avg`, `<name>.exp_avg_sq` of every parameter, cut
as the parameter is; the section holds type "adamw", step, betas, eps and weight_decay.

Any torch.optim optimizer (every class of torch.optim but LBFGS, whose history is lists of flattened
tensors of all parameters together; tests/test_byo_state.py builds each one from torch's own list):
  - a per-parameter state tensor of its parameter's shape (exp_avg, exp_avg_sq, max_exp_avg_sq,
    momentum_buffer, ...) is stored as the global tensor `<name>.optim.<key>`, cut into the same tp slices and
    written by the same rank as its parameter, so any layout can load it exactly as it loads the parameter;
  - a state tensor of another shape (Adafactor's factored row_var / col_var) is stored whole, as a global
    tensor of its own shape, for a parameter that is whole on its rank (not split over tp: torch.optim
    computes such state from the slice it sees, which is no slice of a global tensor); it loads wherever its
    parameter is whole again, and a load that would split the parameter is refused naming both;
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
from typing import Optional

import torch

from ..base.errors import CheckpointError
from ..parallel.agree import everyone
from ..parallel.data import ShardedAdamW
from ..parallel.partition import Box, Partition, local_shape, partition_of, valid_view
from .manifest import (DTYPE_NAMES, DTYPES, MOMENTS, SCALAR_DTYPES, STATE_KEY, TORCH_OPTIM, Manifest, entry_for,
                       hyper_ok, short)
from .read import fill


def optimizer_state(optimizer) -> "OptimizerState":
    """The owner of `optimizer`'s checkpoint section (an OptimizerState is returned as it is)."""
    if isinstance(optimizer, OptimizerState):
        return optimizer
    if optimizer is None:
        return OptimizerState()
    if isinstance(optimizer, torch.optim.Optimizer):
        return TorchOptimState(optimizer)
    if isinstance(optimizer, ShardedAdamW):
        return AdamWState(optimizer)
    raise CheckpointError(f"optimizer: expected megalite's ShardedAdamW, a torch.optim.Optimizer or None, got a "
                          f"{class_name(optimizer)}")


class OptimizerState:
    """No optimizer: the weights only (the interface every kind implements)."""
    optimizer = None
    zero1 = False
    per_tensor = False  # a ZeRO-2 or 3 optimizer: its pieces are cut tensor by tensor (plan_writes' per_tensor)
    shard = 0  # over how many dp x cp ranks it cuts (0: all; hybrid sharding: parallel.dp_shard)
    fresh = ""  # the end of the warning when a checkpoint holds no state for this kind

    def section(self, named, grid) -> Optional[dict]:
        return None

    def slices(self, named, model_slices: list, grid) -> list:
        """[(WriteItem, partition, tensor)]: this rank's state beside each planned model slice (partition,
        WriteItem), cut as it is (`WriteItem.state(kind)`)."""
        return []

    def chunked(self) -> frozenset:
        """The parameters whose weights this optimizer holds in chunks (ZeRO-3: empty between steps)."""
        return frozenset()

    def weight(self, it):
        """The planned model slice `it` from the optimizer's own copy of the weights (a ZeRO-3 rank's chunk: its
        parameter is not whole between steps), or None: read it from the parameter."""
        return None

    def settle(self) -> None:
        """Wait for an async save still writing from the optimizer's tensors."""

    def holds_state(self, man: Manifest) -> bool:
        return True

    def plan_load(self, man: Manifest, step, plan: list):
        return None

    def load(self, reader, man: Manifest, todo, grid) -> None:
        pass


class AdamWState(OptimizerState):
    """megalite's ShardedAdamW: its moments where it holds them (a ZeRO-1 rank: the piece it owns)."""
    fresh = "AdamW moments start from zero and the optimizer step count from 0"

    def __init__(self, optimizer):
        self.optimizer, self.zero1 = optimizer, bool(optimizer.zero1)
        self.per_tensor = bool(getattr(optimizer, "per_tensor", False))
        self.shard = optimizer.dp.size if self.per_tensor else 0

    def section(self, named, grid) -> dict:
        o = self.optimizer
        return {"type": "adamw", "step": o.step_count, "betas": list(o.betas), "eps": o.eps,
                "weight_decay": o.weight_decay}

    def slices(self, named, model_slices: list, grid) -> list:
        out = []
        for part, it in model_slices:  # the moments this rank holds start at piece_of's start
            start = self.optimizer.piece_of(it.name)[0]
            a, b = it.flat or (0, it.box.numel)
            for kind, store in (("exp_avg", self.optimizer.exp_avg), ("exp_avg_sq", self.optimizer.exp_avg_sq)):
                t = store[it.name][a - start:b - start]
                out.append((it.state(kind), part, t if it.flat else t.view(it.box.shape)))
        return out

    def chunked(self) -> frozenset:
        return frozenset(self.optimizer.exp_avg) if self.optimizer.level >= 3 else frozenset()

    def weight(self, it):
        o = self.optimizer
        if o.level < 3:
            return None
        start = o.piece_of(it.name)[0]  # the plan cuts as the chunk is held (per tensor, same ranks)
        a, b = it.flat or (0, it.box.numel)
        t = o.shards.weight(it.name)[a - start:b - start]
        return t if it.flat else t.view(it.box.shape)

    def settle(self) -> None:
        self.optimizer.settle()

    def holds_state(self, man: Manifest) -> bool:
        return bool(man.optimizer_state)

    def plan_load(self, man: Manifest, step, plan: list) -> list:
        """[(name, box, {moment: entry})] for every parameter of `plan` [(name, param, partition, entry, box)]."""
        if man.optimizer and man.optimizer.get("type") == TORCH_OPTIM:
            raise CheckpointError(f"{step.name} holds the state of a torch.optim optimizer "
                                  f"({man.optimizer['class']}), not of megalite's AdamW; pass optimizer=None to "
                                  f"load the weights only")
        return [(name, box, {m: entry_for(man.optimizer_state, f"{name}.{m}", part.global_shape, step)
                             for m in MOMENTS}) for name, _, part, _, box in plan
                if name in self.optimizer.exp_avg]  # its parameters (a module's buffers have no moments)

    def load(self, reader, man: Manifest, todo: list, grid) -> None:
        o = self.optimizer
        with torch.no_grad():
            for name, box, moments in todo:
                a, b = o.piece_of(name)
                for moment, store in (("exp_avg", o.exp_avg), ("exp_avg_sq", o.exp_avg_sq)):
                    target = store[name] if o.zero1 else store[name].view(box.shape)
                    fill(target, lambda out: reader.read(moments[moment], box, flat=(a, b) if o.zero1 else None,
                                                         out=out))
        o.step_count = int(man.optimizer["step"]) if man.optimizer else 0


class TorchOptimState(OptimizerState):
    """Any torch.optim optimizer (see the module docstring)."""
    fresh = "the optimizer starts fresh"

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self._mine = None  # this rank's groups, scalars and state tensors (computed once per save)

    def mine(self, named, grid) -> dict:
        """This rank's param groups, scalar state and state tensors, checked (computed once)."""
        if self._mine is None:
            self._mine = _this_rank(named, self.optimizer, grid.layout.tp)
        return self._mine

    def section(self, named, grid) -> dict:
        return _describe(self, named, grid)

    def slices(self, named, model_slices: list, grid) -> list:
        """Each state tensor beside its parameter: a planned model slice brings the same slice of each of its
        parameter's state tensors (same box, same writer); a state tensor of another shape comes whole with
        the parameter's first piece (its parameter is whole on this rank: `_this_rank`)."""
        c, L = grid.coord, grid.layout
        tensors = self.mine(named, grid)["tensors"]
        keys: dict = {}
        for name, key in tensors:
            keys.setdefault(name, []).append(key)
        out = []
        for part, it in model_slices:
            for key in sorted(keys.get(it.name, ())):
                t = tensors[it.name, key].detach()
                if tuple(t.shape) != tuple(local_shape(part, L.tp)):  # not the parameter's shape
                    if not it.flat or it.flat[0] == 0:
                        whole = Partition(tuple(t.shape), placement=part.placement)
                        out.append((it.state(f"optim.{key}", tuple(t.shape)), whole, t))
                    continue
                t = valid_view(t, part, c.tp, L.tp)
                if it.flat:  # the planned piece of the box (the write plan cuts a stage's slice over dp)
                    t = t.reshape(-1)[it.flat[0]:it.flat[1]]
                out.append((it.state(f"optim.{key}"), part, t))
        return out

    def holds_state(self, man: Manifest) -> bool:
        return man.optimizer is not None

    def plan_load(self, man: Manifest, step, plan: list) -> list:
        return _plan_load(man, step, plan, self.optimizer)

    def load(self, reader, man: Manifest, todo, grid) -> None:
        _load(reader, man, todo, self.optimizer, grid)


# ---------------------------------------------------------------- torch.optim: the section and the load
def class_name(optimizer) -> str:
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def _json_hyper(v, at: str):
    if isinstance(v, tuple):
        v = list(v)
    if not hyper_ok(v):
        raise CheckpointError(f"optimizer {at} is {type(v).__name__} {short(v)}: only numbers, strings, "
                              f"booleans, None and lists of them are checkpointed")
    return v


def _scalar(v, at: str) -> dict:
    if torch.is_tensor(v):
        name = next((k for k, d in SCALAR_DTYPES.items() if d == v.dtype), None)
        if name is None:
            raise CheckpointError(f"optimizer {at} is a 0-dim {v.dtype} tensor (expected one of "
                                  f"{', '.join(SCALAR_DTYPES)})")
        return {"dtype": name, "value": v.item()}
    return {"value": v}


def _this_rank(named, optimizer, tp: int) -> dict:
    """This rank's param groups (by global name), scalar state and state tensors, checked."""
    names = {id(p): n for n, p in named}
    groups, scalars, tensors = [], {}, {}
    for k, g in enumerate(optimizer.param_groups):
        hyper = {key: _json_hyper(v, f"param_groups[{k}].{key}") for key, v in g.items()
                 if key not in ("params", "param_names")}
        bad = [key for key in hyper if not STATE_KEY.match(key)]
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
                if not isinstance(key, str) or not STATE_KEY.match(key):
                    raise CheckpointError(f"optimizer state key {key!r} of parameter '{name}' is not an identifier")
                if torch.is_tensor(v) and v.dim() > 0:
                    part = partition_of(p)
                    if v.shape != p.shape and part.dim is not None and tp > 1:
                        raise CheckpointError(f"optimizer {at} has shape {list(v.shape)}, not the parameter's "
                                              f"{list(p.shape)}, and the parameter is split over tp = {tp}: a state "
                                              f"tensor of another shape is checkpointed only for a parameter held "
                                              f"whole (torch.optim computed it from this rank's slice alone)")
                    if v.numel() == 0:
                        raise CheckpointError(f"optimizer {at} has shape {list(v.shape)}: a tensor with no "
                                              f"elements cannot be checkpointed")
                    if v.dtype not in DTYPE_NAMES:
                        raise CheckpointError(f"optimizer {at} is {v.dtype} (expected one of {', '.join(DTYPES)})")
                    tensors[name, key] = v
                elif torch.is_tensor(v) or (isinstance(v, (int, float)) and not isinstance(v, bool)):
                    scalars.setdefault(name, {})[key] = _scalar(v, at)
                else:
                    raise CheckpointError(f"optimizer {at} is a {type(v).__name__}: only tensors and numbers "
                                          f"are checkpointed")
        groups.append({"hyper": hyper, "params": members})
    return {"class": class_name(optimizer), "groups": groups, "scalars": scalars, "tensors": tensors}


def _describe(owner: TorchOptimState, named, grid) -> dict:
    """The manifest's optimizer section, gathered from every rank (each pipeline stage knows only its own
    parameters), so every rank returns the same one; a problem on any rank is raised on every rank.
    Collective over the grid's `cpu` group."""
    try:
        mine, error = owner.mine(named, grid), None
    except CheckpointError as e:
        mine, error = None, f"rank {grid.rank}: {e}" if grid.layout.world_size > 1 else str(e)
    entry = (error, None if mine is None else {k: v for k, v in mine.items() if k != "tensors"})
    found = everyone(entry, grid)
    errors = [e for e, _ in found if e]
    if errors:
        raise CheckpointError(errors[0])
    first = found[0][1]
    groups = [{"params": [], **g["hyper"]} for g in first["groups"]]
    listed = [set() for _ in groups]
    scalars = {}
    for r, (_, d) in enumerate(found):
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
    return {"type": TORCH_OPTIM, "class": first["class"], "step": int(max(steps, default=0)),
            "param_groups": groups, "scalars": scalars}


def _plan_load(man: Manifest, step, plan: list, optimizer) -> list:
    """Check the checkpoint's torch.optim state against `optimizer` before anything changes; returns what
    `load` reads: [(group index, param, name, partition, box, [(key, entry)], scalars)]."""
    sec = man.optimizer
    if sec is None or sec.get("type") != TORCH_OPTIM:
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
            entries = sorted(by_param.get(name, []))
            for key, e in entries:
                if tuple(e.shape) != tuple(part.global_shape) and box != Box.whole(part.global_shape):
                    raise CheckpointError(f"{step.name}: optimizer state '{key}' of parameter '{name}' has shape "
                                          f"{list(e.shape)}, not the parameter's: it loads only where the parameter "
                                          f"is whole, and this layout splits it over tp")
            out.append((k, p, name, part, box, entries, sec["scalars"].get(name, {})))
    return out


def _load(reader, man: Manifest, todo: list, optimizer, grid) -> None:
    """Read every state tensor (this rank's slice of it) and scalar, and hand them to optimizer.load_state_dict
    together with the checkpoint's hyperparameters (keys the checkpoint lacks keep the constructor's values)."""
    c, L = grid.coord, grid.layout
    state = {}
    for i, (_, p, name, part, box, entries, scalars) in enumerate(todo):
        s = {}
        for key, entry in entries:
            if tuple(entry.shape) != tuple(part.global_shape):  # another shape: whole (checked in _plan_load)
                s[key] = reader.read(entry, Box.whole(entry.shape), out=torch.empty(entry.shape, dtype=entry.torch_dtype))
                continue
            full = torch.zeros(local_shape(part, L.tp), dtype=entry.torch_dtype)
            view = valid_view(full, part, c.tp, L.tp)
            got = reader.read(entry, box, out=view if view.is_contiguous() else None)
            if got.data_ptr() != view.data_ptr():
                view.copy_(got.view(view.shape))
            s[key] = full
        for key, rec in scalars.items():
            dt = rec.get("dtype")
            s[key] = rec["value"] if dt is None else torch.tensor(rec["value"], dtype=SCALAR_DTYPES[dt])
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
