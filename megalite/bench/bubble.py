"""`megalite bench train`, table 5: the bubble of plain and interleaved 1F1B, measured the way the formula counts.

(pp-1)/(V*m + pp-1) (Narayanan et al., 2021) is the idle share of one pipeline step when every virtual stage
takes the same fixed time per forward and per backward, communication is free, and the step is the window from
the first stage's first forward to the last backward anywhere. So the idle of a rank is

    idle = 1 - busy / window,   window = max(end) - min(start) over the ranks (one step),
                                busy   = its own schedule time minus its time inside torch.distributed calls

with every rank starting its schedule after a barrier (time.perf_counter is CLOCK_MONOTONIC: one clock for all
processes of a host); the table shows the mean over ranks of the step with the shortest window. A rank that finishes early (the
last stage drains its backwards first) is idle until the window closes, as in the formula. The older measure,
time inside torch.distributed / the rank's *own* schedule time, misses that tail and is shown beside it.

Two kinds of rows, run by the same gloo processes:
  wait   the real schedule functions (pipeline.one_f_one_b, pipeline.interleaved) and the real gloo P2P,
         sending activation-shaped messages, but each chunk's forward is a sleep of t_f/V and its backward of
         2 t_f/V: no CPU is used, so p processes on fewer cores do not slow each other down. The formula's
         assumptions hold except that messages cost what gloo makes them cost. t_f is calibrated to the model:
         the model rows' busy time per micro-batch / 3 (a backward costs about two forwards).
  model  the real GPT stages in train_step: compute competes for the machine's cores (with p ranks on fewer
         cores, a stage computes slower while its neighbours compute too, and "idle" stretches with it), and the
         first and last chunks carry the embeddings and the LM head + loss, so stages are not equal.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

MIN_WAIT_S = 0.04  # a floor for t_f: a shared host's wake-up latency (0.1-5 ms per op here) stays small beside it


class _Wait(torch.autograd.Function):
    """forward: sleep t_f seconds, identity; backward: sleep t_b seconds, identity. `w` is a dummy parameter so
    that the first stage's output needs a gradient."""

    @staticmethod
    def forward(ctx, x, w, t_f: float, t_b: float):
        time.sleep(t_f)
        ctx.t_b = t_b
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.t_b)
        return g, None, None, None


class _Stamped:
    """Wrap a schedule function: barrier, then record (start, end, seconds inside torch.distributed)."""

    def __init__(self, fn, acc: list):
        self.fn, self.acc, self.steps = fn, acc, []

    def __call__(self, *a, **k):
        dist.barrier()
        c0, t0 = self.acc[0], time.perf_counter()
        out = self.fn(*a, **k)
        self.steps.append((t0, time.perf_counter(), self.acc[0] - c0))
        return out


def _model_rows(o: dict, world: int, grid, acc: list, vpp: int, m: int, cfg_of) -> list:
    from ..run import train as train_mod
    from ..parallel.pipeline import SCHEDULES, schedule_name
    model = {**o["model"], "n_layer": max(o["model"]["n_layer"], 2 * world)}  # every chunk needs a layer
    tr = train_mod.build(cfg_of({**o, "model": model}, (1, world, 1), o["micro"], o["micro"] * m, vpp=vpp),
                         grid, torch.device("cpu"))
    # train_step asks pipeline.get_schedule, which looks the schedule up in SCHEDULES: stamp that entry for the run
    key = schedule_name("1f1b", vpp)
    inner = SCHEDULES[key]
    SCHEDULES[key] = stamped = _Stamped(inner, acc)
    try:
        for _ in range(o["steps"] + 1):
            train_mod.train_step(tr)
    finally:
        SCHEDULES[key] = inner
    return stamped.steps[1:]  # the first step warms up


def _wait_rows(o: dict, world: int, grid, acc: list, vpp: int, m: int, t_f: float) -> list:
    from ..parallel.pipeline import P2P, interleaved, one_f_one_b
    shape = (o["micro"], o["model"]["block_size"], o["model"]["n_embd"])
    w = torch.zeros((), requires_grad=True)
    last = grid.is_last_stage

    def stage_fn(x, micro, chunk=0):
        out = _Wait.apply(x, w, t_f / vpp, 2 * t_f / vpp)
        return out.sum() if last and chunk == vpp - 1 else out

    inputs = [torch.zeros(shape) for _ in range(m)]
    p2p = P2P(grid, shape, torch.float32, torch.device("cpu"))
    if vpp > 1:
        run = _Stamped(lambda: interleaved(stage_fn, inputs, m, grid, p2p, vpp), acc)
    else:
        run = _Stamped(lambda: one_f_one_b(stage_fn, inputs, m, grid, p2p), acc)
    for _ in range(o["steps"] + 1):
        run()
    return run.steps[1:]


def measure(o: dict, world: int, acc: list, cfg_of) -> list:
    """On each of `world` gloo ranks (pp = world): model rows, then wait rows calibrated to them (or with
    t_f = o["wait_ms"]), for V = 1, 2 and the m of o["ms"] that interleaving allows (m % pp == 0, m >= 4).
    Returns this rank's rows with their raw (start, end, seconds in torch.distributed) per step."""
    from ..parallel.grid import Layout, ParallelGrid
    grid = ParallelGrid.create(Layout(1, world, 1))
    ms = [m for m in o["ms"] if m % world == 0 and m >= 4]
    rows = []
    for vpp in (1, 2):
        for m in ms:
            rows.append({"kind": "model", "pp": world, "vpp": vpp, "m": m, "stage": grid.coord.pp,
                         "steps": _model_rows(o, world, grid, acc, vpp, m, cfg_of)})
    # t_f: the model's busy seconds per micro-batch forward on its slowest rank, from its plain 1F1B rows
    if o.get("wait_ms") is None:
        busy = [(t1 - t0 - c) / (3 * r["m"]) for r in rows if r["vpp"] == 1 for t0, t1, c in r["steps"]]
        t_f = torch.tensor([statistics.median(busy)])
        dist.all_reduce(t_f, op=dist.ReduceOp.MAX)
        t_f = max(float(t_f), o.get("min_wait_s", MIN_WAIT_S))
    else:
        t_f = o["wait_ms"] / 1000
    for vpp in (1, 2):
        for m in ms:
            rows.append({"kind": "wait", "pp": world, "vpp": vpp, "m": m, "stage": grid.coord.pp, "t_f": t_f,
                         "steps": _wait_rows(o, world, grid, acc, vpp, m, t_f)})
    return rows


def idle_of(ranks_steps: list) -> dict:
    """ranks_steps[rank] = [(start, end, seconds in torch.distributed) per step]: the idle share over the
    common window and the older own-window measure (means over ranks), and the step window, of the step with
    the shortest window (best of the steps, as timeit takes the best: the host's load bursts only add to it)."""
    best = None
    for stamps in zip(*ranks_steps):
        window = max(t1 for _, t1, _ in stamps) - min(t0 for t0, _, _ in stamps)
        if best is None or window < best[0]:
            best = window, stamps
    window, stamps = best
    return {"idle": statistics.mean(1 - (t1 - t0 - c) / window for t0, t1, c in stamps),
            "idle_own": statistics.mean(c / (t1 - t0) for t0, t1, c in stamps), "step_ms": window * 1000}


def summarise(per_rank: list) -> list:
    """per_rank: every rank's `measure` rows. One row per (kind, pp, vpp, m): idle_of's numbers, the formula,
    t_f, and plain 1F1B's idle of the same kind and m beside it."""
    out = []
    for i, r0 in enumerate(per_rank[0]):
        kind, pp, vpp, m = r0["kind"], r0["pp"], r0["vpp"], r0["m"]
        out.append({"kind": kind, "pp": pp, "vpp": vpp, "m": m, **idle_of([rows[i]["steps"] for rows in per_rank]),
                    "theory": (pp - 1) / (vpp * m + pp - 1), "t_f_ms": r0.get("t_f", 0.0) * 1000})
    for r in out:
        plain = next(x for x in out if (x["kind"], x["pp"], x["vpp"], x["m"]) == (r["kind"], r["pp"], 1, r["m"]))
        r["plain_idle"] = plain["idle"]
    return out
