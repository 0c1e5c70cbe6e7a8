"""`megalite bench train`, tables 4-7: the memory and bubble features and bf16 (issue 13).

4. Activation bytes saved for backward by one transformer layer, for recompute none / selective / full x
   sequence parallelism off / on at tp = 2 and 4: measured with saved_tensors_hooks (distinct storages,
   parameters excluded) next to Korthikanti et al. (2022)'s per-layer count adapted to our kernels
   (`layer_activation_bytes`).
5. Bubble of the interleaved 1F1B schedule (vpp = 2) against plain 1F1B at pp = 2 and 4, m = 4 and 8, measured
   over the step's common window, on the real model and with each chunk's compute replaced by a calibrated
   sleep (bubble.py), vs (pp-1)/(V*m + pp-1).
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

from ..parallel import agree
from . import SavedBytes, StreamTable, patch_dist
from . import bubble as bubble_mod


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


def korthikanti_table2_bytes(recompute: str, s: int, b: int, h: int, a: int, t: int, sp: bool):
    """Korthikanti et al. (2022), Table 2, as printed: bytes per layer with 16-bit activations, 1-byte dropout
    masks and the 5as^2b attention scores/softmax/mask; None where the table has no row (full + sp)."""
    if recompute == "full":
        return None if sp else 2 * s * b * h
    scores = 0 if recompute == "selective" else 5 * a * s / (h * t)
    per = (34 / t if sp else 10 + 24 / t) + scores
    return s * b * h * per


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


def _overlap(o: dict, layouts: list) -> list:
    from ..run import train as train_mod
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


def _worker(rank: int, world: int, tmp: str, o: dict, part: str) -> None:
    """One table's measurements on `world` gloo ranks; rank 0 writes every rank's rows to features-<part>-<world>.json."""
    from ..config import ModelConfig
    from ..parallel.grid import Layout, ParallelGrid
    acc, out = [0.0], []
    if part == "memory":
        grid = ParallelGrid.create(Layout(world, 1, 1))
        out = [{"tp": world, "recompute": rc, "sp": sp, "bytes": _measure_layer(grid, ModelConfig(**o["model"]),
                                                                                 o["micro"], sp, rc)}
               for rc in ("none", "selective", "full") for sp in (False, True)]
    patch_dist(acc)
    if part == "bubble":
        out = bubble_mod.measure(o, world, acc, _cfg)
    elif part == "overlap":
        out = _overlap(o, o["overlap_layouts"].get(str(world), []))
    everyone = agree.everyone(out)  # every rank's rows, on the job's default group
    if rank == 0:
        with open(os.path.join(tmp, f"features-{part}-{world}.json"), "w") as f:
            json.dump(everyone, f)


# ---------------------------------------------------------------- the driver
def _launch(o: dict, world: int, part: str) -> list:
    from ..testing import run_parallel
    run_parallel(_worker, world, tmp_dir=o["work"], args=(o, part))
    with open(os.path.join(o["work"], f"features-{part}-{world}.json")) as f:
        return json.load(f)


def bench_features(o: dict, worlds: list, run_single, parts=("memory", "interleaved", "overlap", "precision"),
                   log=print) -> dict:
    """Tables 4-7 for the bench model in `o` (see bench_train), each printed row by row as it is measured;
    run_single(kind, raw, steps) times one process. `parts` picks the tables."""
    m = o["model"]
    s, b, h, a = m["block_size"], o["micro"], m["n_embd"], m["n_head"]
    o = {**o, "overlap_layouts": {str(w): [lay for lay in ((1, 1, w), (2, 1, w // 2))
                                            if lay[2] > 1 and m["n_head"] % lay[0] == 0
                                            and o["batch"] % (o["micro"] * lay[2]) == 0] for w in worlds}}
    out = {"memory": [], "interleaved": [], "overlap": [], "precision": []}
    if "memory" in parts:
        log(f"\n4. activation bytes saved for backward by one layer (micro-batch {b}, seq {s}, hidden {h}, {a} heads, "
            f"fp32, dropout 0): saved_tensors_hooks vs Korthikanti et al. adapted "
            f"(megalite.bench.features.layer_activation_bytes); Table 2 KiB: the paper's own formula "
            f"(16-bit, dropout masks, s x s attention scores; korthikanti_table2_bytes)")
        t = StreamTable(["tp", "recompute", "sp", "measured KiB", "formula KiB", "measured/formula", "vs sp off",
                         "Table 2 KiB"], [2, 9, 3, 12, 11, 16, 9, 11], log=log)
        for w in worlds:
            rows = _launch(o, w, "memory")[0]  # every rank measures the same
            for r in rows:
                want = layer_activation_bytes(r["recompute"], s, b, h, a, w, r["sp"])
                off = next(x["bytes"] for x in rows if x["recompute"] == r["recompute"] and not x["sp"])
                out["memory"].append({**r, "formula": want, "ratio": r["bytes"] / want})
                paper = korthikanti_table2_bytes(r["recompute"], s, b, h, a, w, r["sp"])
                t.row([w, r["recompute"], "on" if r["sp"] else "off", f"{r['bytes'] / 1024:.1f}",
                       f"{want / 1024:.1f}", f"{r['bytes'] / want:.3f}", f"{r['bytes'] / off:.3f}",
                       None if paper is None else f"{paper / 1024:.1f}"])
    if "interleaved" in parts:
        log("\n5. interleaved 1F1B bubble: idle = 1 - busy / window, window = first start to last end over the "
            "stages (after a barrier), busy = schedule time outside torch.distributed; mean over stages, of "
            "the step with the shortest window (megalite.bench.bubble). wait rows: the real schedule and gloo p2p with each chunk's "
            "forward a sleep of t_f/V and backward 2t_f/V (the formula's assumptions: equal stages, no CPU "
            "contention); model rows: the real GPT stages, p processes sharing this machine's cores. "
            "'idle in dist/own' is the older measure (time in torch.distributed / the stage's own schedule time)")
        t = StreamTable(["rows", "pp", "V", "m", "idle", "theory", "diff", "1F1B idle", "below 1F1B",
                         "idle in dist/own", "step ms", "ideal step ms"], [5, 2, 1, 1, 6, 6, 6, 9, 10, 16, 7, 13],
                        log=log)
        for w in worlds:
            if w < 2:
                continue
            rows = bubble_mod.summarise(_launch(o, w, "bubble"))
            for r in sorted(rows, key=lambda r: r["kind"] != "wait"):
                out["interleaved"].append(r)
                ideal = (r["vpp"] * r["m"] + r["pp"] - 1) * 3 * r["t_f_ms"] / r["vpp"] if r["kind"] == "wait" else None
                t.row([r["kind"], r["pp"], r["vpp"], r["m"], f"{r['idle']:.1%}", f"{r['theory']:.1%}",
                       f"{r['idle'] - r['theory']:+.1%}", f"{r['plain_idle']:.1%}",
                       ("yes" if r["idle"] < r["plain_idle"] else "NO") if r["vpp"] > 1 else "-",
                       f"{r['idle_own']:.1%}", f"{r['step_ms']:.0f}", ideal and f"{ideal:.0f}"])
        t_f = {r["pp"]: r["t_f_ms"] for r in out["interleaved"] if r["kind"] == "wait"}
        if t_f:
            how = ("set by --bubble-wait-ms" if o.get("wait_ms") is not None else
                   f"the model's busy time per micro-batch / 3, at least {bubble_mod.MIN_WAIT_S * 1000:.0f} ms")
            log(f"wait rows: t_f = {', '.join(f'{v:.1f} ms at pp {k}' for k, v in t_f.items())} per stage forward "
                f"per micro-batch ({how}); ideal step = (V*m + pp-1) * 3 t_f / V; host load average "
                f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if "overlap" in parts:
        log("\n6. exposed dp gradient reduction: time waiting in GradBuffer.finish() / step time (median step, "
            "slowest rank)")
        t = StreamTable(["tp,pp,dp", "overlap_grad_reduce", "ms/step", "waiting ms", "exposed share"], [8], log=log)
        for w in worlds:
            if not o["overlap_layouts"][str(w)]:
                continue
            results = _launch(o, w, "overlap")
            for i, lay in enumerate(o["overlap_layouts"][str(w)]):
                for j, ov in enumerate((False, True)):
                    ranks = [rank[2 * i + j] for rank in results]
                    step = statistics.median(max(r["times"][k] for r in ranks) for k in range(o["steps"]))
                    wait = statistics.median(max(r["waits"][k] for r in ranks) for k in range(o["steps"]))
                    r = {"layout": tuple(lay), "overlap": ov, "ms_per_step": step * 1000, "wait_ms": wait * 1000,
                         "exposed": wait / step}
                    out["overlap"].append(r)
                    t.row([",".join(map(str, lay)), "on" if ov else "off", f"{step * 1000:.1f}",
                           f"{wait * 1000:.2f}", f"{wait / step:.1%}"])
    if "precision" in parts:
        out["precision"] = _precision(o, run_single, log)
    return out


def _precision(o: dict, run_single, log) -> list:
    m = o["model"]
    raw = lambda prec: {"model": m, "parallel": {"tp": 1, "pp": 1, "dp": 1},  # noqa: E731
                        "train": {"global_batch_size": o["batch"], "micro_batch_size": o["micro"], "steps": 1000,
                                  "warmup_steps": 10, "eval_batches": 1, "out_dir": o["work"], "precision": prec},
                        "data": {"path": o["data"]}}
    log("\n7. precision at (1,1,1) on this CPU (bf16 = autocast; fp32 master weights, grads and moments)")
    t = StreamTable(["precision", "tokens/s", "ms/step", "vs fp32"], [9, 8, 7, 7], log=log)
    times = {"fp32": [], "bf16": []}
    for _ in range(o.get("rounds", 2)):  # alternate, pool the step times: drifts in machine speed hit both
        for prec in times:
            times[prec] += run_single("megalite", raw(prec), o["steps"])["times"]
    out = []
    for prec, ts in times.items():
        med = statistics.median(ts)
        out.append({"precision": prec, "tokens_per_s": o["batch"] * m["block_size"] / med, "ms_per_step": med * 1000})
        t.row([prec, f"{out[-1]['tokens_per_s']:,.0f}", f"{med * 1000:.1f}",
               f"{out[-1]['tokens_per_s'] / out[0]['tokens_per_s']:.2f}x"])
    return out
