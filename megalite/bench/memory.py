"""`megalite bench plan --memory`: each rank's bytes before launch, at a layout, a ZeRO level and a micro-batch.

Every number is counted from the real model's partition tags (the stage built on the meta device, as the write
plan's `stage_tensors`) and the same cut functions the run uses (`dp_pieces`, `shard_range`), never from a
parameter count formula: what a rank holds between steps (fp32, 4 bytes an element)

    parameters   zero < 3: its tp/pp slice (vocab padding rows included); 3: chunk r of each tensor
    gradients    zero < 2: the slice (GradBuffer's buckets); 2, 3: chunk r of each tensor
    optimizer    AdamW's two moments: of the valid elements (0), of ZeRO-1's flat range (1), of chunk r (2, 3)
    gathered     zero 3: the largest unit (a block, or the rest of the stage) gathered whole in a step
    activations  saved for backward per micro-batch and layer by Korthikanti et al.'s count as
                 docs/parallelism.md tables it for GPT-2 (other families: the same count, an approximation), times the
                 layers of the stage and the micro-batches 1F1B keeps in flight there, min(pp - stage, m)

and the bytes its collectives carry per training step (each collective counted by the tensor it receives:
an all-reduce's buffer, an all-gather's output, a reduce-scatter's input), with n the ranks a tensor is cut
over and m the micro-batches per step:

    zero 0    all-reduce of the gradient buckets once
    zero 1    the same, then all-gather of the updated flat ranges (n x ceil(space / n) per flat space)
    zero 2    per unit and micro-batch a reduce-scatter (n x ceil(k / n) per tensor: m x the padded
              gradients), then the updated chunks all-gathered once (as the weights)
    zero 3    the reduce-scatters of 2; per block all-gathers 2m times (reshard_after_forward; else once), the
              rest of the stage once; no gather after the step
    hybrid    (dp_shard) the reduced chunks all-reduced across groups, per unit and micro-batch
`tests/test_zero.py` measures both on live runs (tensor storages held, collective bytes counted) at dp 1/2/4 x
zero 0..3 x tp 1/2 and compares them with these counts (within 1%).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections import defaultdict

from ..parallel.data import dp_pieces, flat_spaces
from ..parallel.grid import Coord, Layout
from ..parallel.partition import local_shape, shard_range, tp_box

F32 = 4


def _unit(part) -> str:
    return part.placement if part.placement.startswith("layer.") else "root"


def predict(model: dict, layout: Layout, coord: Coord, zero: int, m: int, dp_shard: int = 0, vpp: int = 1,
            micro_batch: int = 1, seq: int = 0, sp: bool = False, recompute: str = "none",
            reshard_after_forward: bool = True, stages=None) -> dict:
    """The bytes rank `coord` of `layout` holds and sends (see the module docstring); `stages`: stage_tensors'
    answer for this model, tp and pp (computed when None)."""
    from .plan import stage_tensors
    stages = stages or stage_tensors(model, layout.tp, layout.pp, vpp)
    tensors = stages[coord.pp]
    n_rep = layout.replicas
    level = zero if n_rep > 1 else 0
    n = (dp_shard or n_rep) if level >= 2 else n_rep
    r = layout.replica(coord) % n
    storage = {name: math.prod(local_shape(p, layout.tp)) for name, p in tensors}
    valid = {name: tp_box(p, coord.tp, layout.tp).numel for name, p in tensors}
    chunk = {name: (lambda ab: ab[1] - ab[0])(shard_range(k, r, n)) for name, k in valid.items()}
    padded = {name: n * math.ceil(k / n) for name, k in valid.items()}
    sizes = [(name, valid[name], bool(p.tied_to)) for name, p in tensors]
    units = defaultdict(list)
    for name, p in tensors:
        units[_unit(p)].append(name)
    out = {"params": F32 * (sum(chunk.values()) if level >= 3 else sum(storage.values())),
           "grads": F32 * (sum(chunk.values()) if level >= 2 else sum(storage.values()))}
    if level == 1:
        pieces = dp_pieces(sizes, r, n)
        out["optimizer"] = 2 * F32 * sum(b - a for a, b in pieces.values())
    else:
        out["optimizer"] = 2 * F32 * sum((chunk if level >= 2 else valid).values())
    out["gathered"] = F32 * max(sum(storage[x] for x in names) for names in units.values()) if level >= 3 else 0
    comm = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
    if level <= 1:
        comm["all_reduce"] = F32 * sum(storage.values()) if n_rep > 1 else 0
    if level == 1:
        comm["all_gather"] = F32 * sum(n * math.ceil(sum(k for _, k in sp_) / n) for sp_ in flat_spaces(sizes))
    if level >= 2:
        comm["reduce_scatter"] = F32 * m * sum(padded.values())
        if n_rep > n:  # hybrid
            comm["all_reduce"] = F32 * m * sum(padded.values()) // n
    if level == 2:
        comm["all_gather"] = F32 * sum(padded.values())
    if level == 3:
        gathers = {u: (1 if u == "root" else (2 * m if reshard_after_forward else 1)) for u in units}
        comm["all_gather"] = F32 * sum(gathers[u] * sum(padded[x] for x in names) for u, names in units.items())
    out["comm"] = comm
    out["activations"] = _activations(model, layout, coord, m, micro_batch, seq, sp, recompute,
                                      sum(1 for u in units if u != "root"))
    return out


def _activations(model: dict, layout: Layout, coord: Coord, m: int, b: int, seq: int, sp: bool,
                 recompute: str, layers: int) -> int:
    """Bytes saved for backward on the stage: per layer and micro-batch the GPT-2 count of docs/parallelism.md
    (attention 2sbh + 2sb + 4sbh/t + sba/t, MLP 2sbh + 2sb + 8sbh/t at s = seq / cp; sp divides the replicated
    terms by t; full recompute keeps the block's input, sbh, or sbh/t with sp), times the layers and the
    micro-batches in flight under 1F1B, min(pp - stage, m)."""
    s = (seq or model.get("block_size", 1024)) // layout.cp
    h, a, t = model["n_embd"], model["n_head"], layout.tp
    rep = (4 * s * b * h + 4 * s * b) / (t if sp else 1)
    per_layer = rep + 12 * s * b * h / t + s * b * a / t
    if recompute == "full":
        per_layer = s * b * h / (t if sp else 1)
    return int(F32 * per_layer * layers * min(layout.pp - coord.pp, m))


def memory_rows(model: dict, layout: Layout, zero: int, m: int, **kw) -> list[list]:
    """One row per pipeline stage (its tp rank 0, dp x cp replica 0): the table `bench plan --memory` prints."""
    from . import fmt_bytes
    from .plan import stage_tensors
    stages = stage_tensors(model, layout.tp, layout.pp, kw.get("vpp", 1))
    rows = []
    for s in range(layout.pp):
        p = predict(model, layout, Coord(0, s, 0), zero, m, stages=stages, **kw)
        total = p["params"] + p["grads"] + p["optimizer"]
        rows.append([f"{layout} zero {zero} stage {s}", fmt_bytes(p["params"]), fmt_bytes(p["grads"]),
                     fmt_bytes(p["optimizer"]), fmt_bytes(total), fmt_bytes(p["gathered"]),
                     fmt_bytes(p["activations"]), fmt_bytes(sum(p["comm"].values()))])
    return rows


HEADERS = ["layout", "params", "grads", "AdamW", "p+g+opt", "gathered block", "activations", "sent/step"]


def bench_memory_cli(args, log=print) -> list:
    """`megalite bench plan --memory`: the model from bench plan's flags (and --arch, --n-kv-head,
    --intermediate-size), one table row per stage and --dp size."""
    from . import table
    from .plan import _ints, check_shape
    n_layer, n_embd, block = args.n_layer or 96, args.n_embd or 12288, args.block_size or 2048
    vocab = args.vocab_size or 50304
    dps = _ints(args.dp, "--dp")
    check_shape(n_layer, n_embd, args.n_head, vocab, block, args.tp, args.pp, args.vpp, cp=args.cp)
    from .. import models
    model = {"n_layer": n_layer, "n_embd": n_embd, "n_head": args.n_head, "vocab_size": vocab,
             "block_size": block, "arch": args.arch, "n_kv_head": args.n_kv_head,
             "intermediate_size": args.intermediate_size}
    model.update({k: v for k, v in models.spec(args.arch).defaults.items() if k not in model})  # the family's
    rows = []
    for dp in dps:
        layout = Layout(args.tp, args.pp, dp, getattr(args, "cp", 1))
        m = args.microbatches or 4 * args.pp
        rows += memory_rows(model, layout, args.zero, m, dp_shard=args.dp_shard, vpp=args.vpp,
                            micro_batch=args.micro_batch, seq=model["block_size"], sp=args.tp > 1)
    log(f"memory per rank (fp32 weights, grads and AdamW moments; tp rank 0, replica 0 of each stage), "
        f"{args.microbatches or 4 * args.pp} micro-batches of {args.micro_batch} x {model['block_size']} tokens "
        f"per step, sp on when tp > 1; sent/step = bytes its dp x cp collectives carry per step")
    log(table(HEADERS, rows))
    return rows


# ---------------------------------------------------------------- measured: `bench train`'s ZeRO table
def held_bytes(tr) -> dict:
    """Bytes of the distinct tensor storages a Trainer holds between steps: weights (zero 3: the chunks),
    gradient buffers (or chunks) and AdamW moments: what `predict` counts (tensor bytes, not RSS)."""
    def total(tensors):
        seen = {}
        for t in tensors:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())
    weights = [p.data for _, p in tr.params] + list(getattr(tr.grads, "weights", {}).values())
    grads = getattr(tr.grads, "buffers", None) or list(tr.grads.grads.values())
    moments = list(tr.optimizer.exp_avg.values()) + list(tr.optimizer.exp_avg_sq.values())
    return {"params": total(weights), "grads": total(grads), "optimizer": total(moments)}


def sent_bytes(tr) -> int:
    """Bytes handed to the gradient and optimizer collectives so far (GradBuffer/ShardedState/ShardedAdamW)."""
    return sum(tr.grads.sent.values()) + sum(tr.optimizer.sent.values())


def _zero_worker(rank: int, world: int, tmp: str, o: dict) -> None:
    import torch
    from ..config import Config, num_microbatches
    from ..parallel.grid import Layout, ParallelGrid
    from ..run.train import build, train_step
    grid = ParallelGrid.create(Layout(1, 1, world))
    rows = []
    for zero in range(4):
        cfg = Config.from_dict({"model": o["model"], "parallel": {"dp": world, "zero": zero},
                                "train": {"global_batch_size": o["batch"], "micro_batch_size": o["micro"],
                                          "steps": 1000, "warmup_steps": 10, "eval_batches": 1,
                                          "out_dir": o["work"]}, "data": {"path": o["data"]}})
        tr = build(cfg, grid, torch.device("cpu"))
        train_step(tr)  # warm-up
        sent0, times = sent_bytes(tr), []
        for _ in range(o["steps"]):
            t0 = time.perf_counter()
            train_step(tr)
            times.append(time.perf_counter() - t0)
        plan = predict(o["model"], grid.layout, grid.coord, zero, num_microbatches(cfg))
        rows.append({"zero": zero, "times": times, "held": sum(held_bytes(tr).values()),
                     "plan": plan["params"] + plan["grads"] + plan["optimizer"],
                     "sent": (sent_bytes(tr) - sent0) / o["steps"], "plan_sent": sum(plan["comm"].values())})
    with open(os.path.join(tmp, f"zero-{world}-{rank}.json"), "w") as f:
        json.dump(rows, f)


def bench_zero(o: dict, nproc: int, log=print) -> list:
    """Table 11 of `bench train`: step time and rank 0's bytes at zero 0..3 x dp 2 and nproc (pure dp),
    measured beside `predict`'s count."""
    from ..testing import run_parallel
    from . import StreamTable
    dps = sorted({2, nproc})
    log(f"\n11. ZeRO levels at dp {' and '.join(map(str, dps))} (tp = pp = 1): ms/step (median over steps of the "
        f"slowest rank); "
        f"rank 0's weights + grads + AdamW bytes held between steps and bytes its collectives carry per step, "
        f"measured (tensor storages; counted at each collective) beside `bench plan --memory`'s count")
    t = StreamTable(["dp", "zero", "ms/step", "held KiB", "plan KiB", "sent KiB/step", "plan KiB/step"],
                    [2, 4, 7, 8, 8, 13, 13], log=log)
    out = []
    for dp in dps:
        run_parallel(_zero_worker, dp, tmp_dir=o["work"], args=(o,))
        ranks = []
        for r in range(dp):
            with open(os.path.join(o["work"], f"zero-{dp}-{r}.json")) as f:
                ranks.append(json.load(f))
        for i, row in enumerate(ranks[0]):
            step = statistics.median(max(rk[i]["times"][k] for rk in ranks) for k in range(len(row["times"])))
            out.append({"dp": dp, **{k: v for k, v in row.items() if k != "times"}, "ms_per_step": step * 1000})
            t.row([dp, row["zero"], f"{step * 1000:.1f}", f"{row['held'] / 1024:.1f}", f"{row['plan'] / 1024:.1f}",
                   f"{row['sent'] / 1024:.1f}", f"{row['plan_sent'] / 1024:.1f}"])
    return out
