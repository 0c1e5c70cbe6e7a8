"""`megalite bench train`, tables 4-7: the memory and bubble features and bf16 (issue 13).

4. Activation bytes saved for backward by one transformer layer, for recompute none / selective / full x
   sequence parallelism off / on at tp = 2 and 4: measured with saved_tensors_hooks (distinct storages,
   parameters excluded) next to Korthikanti et al. (2022)'s per-layer count adapted to our kernels
   (`layer_activation_bytes`).
5. Bubble of the interleaved 1F1B schedule (vpp = 2) against plain 1F1B at pp = 2 and 4, m = 4 and 8:
   idle = time inside torch.distributed calls / schedule time, mean over stages, vs (pp-1)/(V*m + pp-1).
6. Exposed data-parallel communication with and without overlap_grad_reduce: the time the step waits in
   GradBuffer.finish() (all of the reduction without overlap; what is left of it with) over the step time.
7. bf16 autocast vs fp32 tokens/s at (1,1,1) on this machine's CPU.
"""
from __future__ import annotations

import json
import os
import statistics
import time

import torch

from . import SavedBytes, patch_dist, table


# ---------------------------------------------------------------- 4. activation memory
def layer_activation_bytes(recompute: str, s: int, b: int, h: int, a: int, t: int, sp: bool,
                           bytes_per: int = 4) -> int:
    """Bytes one layer saves for backward (dropout 0), Korthikanti et al. (2022) eq. 1-4 adapted to megalite.

    The paper counts sbh(34 + 5as/h) bytes in 16-bit (10 sbh replicated over tp, 24 sbh / t split, and the
    5as^2b attention matrices). Adaptations: fp32 (4 bytes per element); dropout 0 (no masks); SDPA keeps no
    attention matrix, only its log-sum-exp (sba/t), and its output is the projection's input (one storage:
    the (b, h, t, d) -> (b, t, h*d) rearrange is a view). Per layer, in elements:
        replicated (cut by t with sp): LN1 input, QKV input, LN2 input, FC input = 4 sbh; LN mean+rstd = 4 sb
        split over tp: q, k, v = 3 sbh/t; attention output = proj input = sbh/t; FC output (GELU input) and
        GELU output (proj input) = 8 sbh/t; log-sum-exp = sba/t
    selective: the attention core keeps only its inputs (q, k, v), so it drops the log-sum-exp (the paper's
    5as^2b attention matrices are what selective saves; SDPA never stores them);
    full keeps only the layer input: sbh (sbh/t with sp).
    """
    r = t if sp else 1
    if recompute == "full":
        elems = s * b * h // r
    else:
        elems = 4 * s * b * h // r + 4 * s * b // r + 12 * s * b * h // t
        if recompute == "none":
            elems += s * b * a // t
    return elems * bytes_per


def _measure_layer(grid, model_cfg, micro: int, sp: bool, recompute: str) -> int:
    from ..model import GPTStage
    model = GPTStage(model_cfg, grid, sp=sp, recompute=recompute)
    model.init_weights(0)
    seq = model_cfg.block_size // (grid.tp.size if sp else 1)
    x = torch.randn(micro, seq, model_cfg.n_embd, generator=torch.Generator().manual_seed(1), requires_grad=True)
    mem = SavedBytes(list(model.parameters()))
    with torch.autograd.graph.saved_tensors_hooks(mem.pack, mem.unpack):
        y = model.run_block(model.layers[0], x)
    y.sum().backward()  # every rank runs the same collectives, and the graph is freed
    return mem.peak


# ---------------------------------------------------------------- the gloo worker
def _cfg(o: dict, layout, micro: int, batch: int, **parallel):
    from ..config import Config
    tp, pp, dp = layout
    return Config.from_dict({"model": o["model"], "parallel": {"tp": tp, "pp": pp, "dp": dp, **parallel},
                             "train": {"global_batch_size": batch, "micro_batch_size": micro, "steps": 1000,
                                       "warmup_steps": 10, "eval_batches": 1, "out_dir": o["work"]},
                             "data": {"path": o["data"]}})


class _Timed:
    """Replace `holder[key]` (a dict entry or a module attribute) by a wrapper that adds each call's wall
    time and its time inside torch.distributed (acc[0], see patch_dist) to .spent."""

    def __init__(self, holder, key, acc):
        self.holder, self.key, self.acc, self.spent = holder, key, acc, [0.0, 0.0]
        get = holder.get if isinstance(holder, dict) else lambda k: getattr(holder, k)
        self.inner = get(key)

    def __call__(self, *a, **k):
        c0, t0 = self.acc[0], time.perf_counter()
        try:
            return self.inner(*a, **k)
        finally:
            self.spent[0] += time.perf_counter() - t0
            self.spent[1] += self.acc[0] - c0

    def _put(self, value):
        if isinstance(self.holder, dict):
            self.holder[self.key] = value
        else:
            setattr(self.holder, self.key, value)

    def __enter__(self):
        self._put(self)
        return self

    def __exit__(self, *exc):
        self._put(self.inner)


def _bubble(o: dict, world: int, acc: list) -> list:
    """Plain (vpp 1) and interleaved (vpp 2) 1F1B at pp = world: idle share of the schedule, per stage."""
    from .. import train as train_mod
    from ..parallel.grid import Layout, ParallelGrid
    grid = ParallelGrid.create(Layout(1, world, 1))
    model = {**o["model"], "n_layer": max(o["model"]["n_layer"], 2 * world)}  # every chunk needs a layer
    rows = []
    for vpp in (1, 2):
        for m in [m for m in o["ms"] if m % world == 0 and m >= 4]:  # interleaving needs m % pp == 0
            tr = train_mod.build(_cfg({**o, "model": model}, (1, world, 1), o["micro"], o["micro"] * m, vpp=vpp),
                                 grid, torch.device("cpu"))
            with (_Timed(train_mod, "interleaved", acc) if vpp > 1 else _Timed(train_mod.SCHEDULES, "1f1b", acc)) as t:
                train_mod.train_step(tr)  # warm-up
                t.spent[:] = [0.0, 0.0]
                for _ in range(o["steps"]):
                    train_mod.train_step(tr)
            rows.append({"pp": world, "vpp": vpp, "m": m, "stage": grid.coord.pp, "idle": t.spent[1] / t.spent[0]})
    return rows


def _overlap(o: dict, layouts: list) -> list:
    from .. import train as train_mod
    from ..parallel.grid import Layout, ParallelGrid
    rows = []
    for lay in layouts:
        grid = ParallelGrid.create(Layout(*lay))
        for overlap in (False, True):
            cfg = _cfg(o, lay, o["micro"], o["batch"], overlap_grad_reduce=overlap, bucket_mb=o["bucket_mb"])
            tr = train_mod.build(cfg, grid, torch.device("cpu"))
            inner, waited = tr.grads.finish, [0.0]

            def timed(_inner=inner):
                t0 = time.perf_counter()
                _inner()
                waited[0] += time.perf_counter() - t0

            tr.grads.finish = timed
            train_mod.train_step(tr)
            times, waits = [], []
            for _ in range(o["steps"]):
                w0, t0 = waited[0], time.perf_counter()
                train_mod.train_step(tr)
                times.append(time.perf_counter() - t0)
                waits.append(waited[0] - w0)
            rows.append({"layout": list(lay), "overlap": overlap, "times": times, "waits": waits})
    return rows


def _worker(rank: int, world: int, tmp: str, o: dict) -> None:
    import torch.distributed as dist
    from ..config import ModelConfig
    from ..parallel.grid import Layout, ParallelGrid
    acc = [0.0]
    out = {"memory": [], "bubble": [], "overlap": []}
    grid = ParallelGrid.create(Layout(world, 1, 1))
    mcfg = ModelConfig(**o["model"])
    for recompute in ("none", "selective", "full"):
        for sp in (False, True):
            out["memory"].append({"tp": world, "recompute": recompute, "sp": sp,
                                  "bytes": _measure_layer(grid, mcfg, o["micro"], sp, recompute)})
    patch_dist(acc)
    out["bubble"] = _bubble(o, world, acc)
    out["overlap"] = _overlap(o, o["overlap_layouts"].get(str(world), []))
    everyone = [None] * world
    dist.all_gather_object(everyone, out)
    if rank == 0:
        with open(os.path.join(tmp, f"features-{world}.json"), "w") as f:
            json.dump(everyone, f)


# ---------------------------------------------------------------- the driver
def bench_features(o: dict, worlds: list, run_single, parts=("memory", "interleaved", "overlap", "precision")) -> dict:
    """Tables 4-7 for the bench model in `o` (see bench_train); run_single(kind, raw, steps) times one process.
    `parts` leaves out the gloo tables when only "precision" is asked for."""
    from ..testing import run_parallel
    m = o["model"]
    o = {**o, "overlap_layouts": {str(w): [lay for lay in ((1, 1, w), (2, 1, w // 2))
                                            if lay[2] > 1 and m["n_head"] % lay[0] == 0
                                            and o["batch"] % (o["micro"] * lay[2]) == 0] for w in worlds}}
    results = {}
    for w in (worlds if set(parts) - {"precision"} else []):
        run_parallel(_worker, w, tmp_dir=o["work"], args=(o,))
        with open(os.path.join(o["work"], f"features-{w}.json")) as f:
            results[w] = json.load(f)
    memory, bubble, overlap = [], [], []
    s, b, h, a = m["block_size"], o["micro"], m["n_embd"], m["n_head"]
    for w in results:
        for r in results[w][0]["memory"]:  # every rank measures the same
            want = layer_activation_bytes(r["recompute"], s, b, h, a, w, r["sp"])
            memory.append({**r, "formula": want, "ratio": r["bytes"] / want})
        per = [x for rank in results[w] for x in rank["bubble"]]
        for vpp in (1, 2):
            for mm in sorted({x["m"] for x in per}):
                rows = [x for x in per if x["vpp"] == vpp and x["m"] == mm]
                bubble.append({"pp": w, "vpp": vpp, "m": mm, "idle": statistics.mean(x["idle"] for x in rows),
                               "theory": (w - 1) / (vpp * mm + w - 1)})
        for i, lay in enumerate(o["overlap_layouts"][str(w)]):
            for j, ov in enumerate((False, True)):
                ranks = [rank["overlap"][2 * i + j] for rank in results[w]]
                step = statistics.median(max(r["times"][k] for r in ranks) for k in range(o["steps"]))
                wait = statistics.median(max(r["waits"][k] for r in ranks) for k in range(o["steps"]))
                overlap.append({"layout": tuple(lay), "overlap": ov, "ms_per_step": step * 1000,
                                "wait_ms": wait * 1000, "exposed": wait / step})
    raw = lambda prec: {"model": m, "parallel": {"tp": 1, "pp": 1, "dp": 1},  # noqa: E731
                        "train": {"global_batch_size": o["batch"], "micro_batch_size": o["micro"], "steps": 1000,
                                  "warmup_steps": 10, "eval_batches": 1, "out_dir": o["work"], "precision": prec},
                        "data": {"path": o["data"]}}
    times = {"fp32": [], "bf16": []}
    for _ in range(o.get("rounds", 2)):  # alternate, pool the step times: drifts in machine speed hit both
        for prec in times:
            times[prec] += run_single("megalite", raw(prec), o["steps"])["times"]
    precision = []
    for prec, ts in times.items():
        med = statistics.median(ts)
        precision.append({"precision": prec, "tokens_per_s": o["batch"] * s / med, "ms_per_step": med * 1000})
    return {"memory": memory, "interleaved": bubble, "overlap": overlap, "precision": precision}


def format_feature_tables(out: dict, model: dict, micro: int) -> str:
    s = ["\n", f"4. activation bytes saved for backward by one layer (micro-batch {micro}, seq {model['block_size']}, "
             f"hidden {model['n_embd']}, {model['n_head']} heads, fp32, dropout 0): saved_tensors_hooks vs "
             f"Korthikanti et al. adapted (megalite.bench.features.layer_activation_bytes)"]
    s.append(table(["tp", "recompute", "sp", "measured KiB", "formula KiB", "measured/formula", "vs sp off"],
                   [[r["tp"], r["recompute"], "on" if r["sp"] else "off", f"{r['bytes'] / 1024:.1f}",
                     f"{r['formula'] / 1024:.1f}", f"{r['ratio']:.3f}",
                     f"{r['bytes'] / next(x['bytes'] for x in out['memory'] if x['tp'] == r['tp'] and x['recompute'] == r['recompute'] and not x['sp']):.3f}"]
                    for r in out["memory"]]))
    s += ["", "5. interleaved 1F1B: idle = time in torch.distributed calls / schedule time (mean over stages) "
              "vs (pp-1)/(vpp*m + pp-1)"]
    s.append(table(["pp", "vpp", "m", "idle measured", "theory", "diff"],
                   [[r["pp"], r["vpp"], r["m"], f"{r['idle']:.1%}", f"{r['theory']:.1%}",
                     f"{r['idle'] - r['theory']:+.1%}"] for r in out["interleaved"]]))
    s += ["", "6. exposed dp gradient reduction: time waiting in GradBuffer.finish() / step time (median step, "
              "slowest rank)"]
    s.append(table(["tp,pp,dp", "overlap_grad_reduce", "ms/step", "waiting ms", "exposed share"],
                   [[",".join(map(str, r["layout"])), "on" if r["overlap"] else "off", f"{r['ms_per_step']:.1f}",
                     f"{r['wait_ms']:.2f}", f"{r['exposed']:.1%}"] for r in out["overlap"]]))
    s += ["", "7. precision at (1,1,1) on this CPU (bf16 = autocast; fp32 master weights, grads and moments)"]
    p = out["precision"]
    s.append(table(["precision", "tokens/s", "ms/step", "vs fp32"],
                   [[r["precision"], f"{r['tokens_per_s']:,.0f}", f"{r['ms_per_step']:.1f}",
                     f"{r['tokens_per_s'] / p[0]['tokens_per_s']:.2f}x"] for r in p]))
    return "\n".join(s)
