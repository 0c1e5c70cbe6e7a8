"""`megalite bench train`: throughput against plain PyTorch, pipeline bubbles, and a layout table.

1. megalite at tp=pp=dp=1 and `PlainGPT` below (the same GPT-2, written the nanoGPT way, with
   torch.optim.AdamW), each in a fresh interpreter: tokens/s (median step after warm-up), peak RSS, and the
   step's CPU time (time.process_time of the one-thread process: its own work, which other jobs on a loaded
   machine disturb far less than the wall clock).
2. Pipeline bubble per schedule: 1 - busy / window, the window running from the first stage's start to the
   last stage's end (after a barrier), busy = a stage's schedule time outside torch.distributed calls, mean
   over stages (megalite.bench.bubble.idle_of), vs (pp-1)/(m+pp-1); and the peak bytes saved for backward
   (a saved_tensors_hooks counter), per stage.
3. Every layout of `nproc` processes: tokens/s and the share of step time inside torch.distributed calls.
4-7. Activation memory per recompute / sp setting, the interleaved schedule's bubble, exposed dp
   communication with and without overlap, bf16 vs fp32 (see features.py).
8. Context parallelism at cp = 1, 2, 4 beside tp at the same world size: saved activation bytes per rank,
   tokens/s and the share of step time in the cp ring's sends (see context.py).
9-10. The Llama family: megalite (1,1,1) vs transformers' LlamaForCausalLM, and a Llama block's saved bytes per
   rank at tp/cp 1, 2, 4 vs its formula (see llama.py); `--llama-only` runs these two alone.
All processes run one thread each (the gloo workers of megalite.testing do). Each table is printed row by row
as its rows are measured (megalite.bench.StreamTable).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..parallel import agree
from . import SavedBytes, StreamTable, paired, patch_dist, reference_step
from .bubble import _Stamped, idle_of
from .context import bench_context
from .features import bench_features
from .llama import bench_llama
from .memory import bench_zero


# ---------------------------------------------------------------- the plain PyTorch reference
class _Attention(nn.Module):
    def __init__(self, c: int, n_head: int):
        super().__init__()
        self.c_attn, self.c_proj, self.n_head = nn.Linear(c, 3 * c), nn.Linear(c, c), n_head

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class _Block(nn.Module):
    def __init__(self, c: int, n_head: int):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(c), _Attention(c, n_head), nn.LayerNorm(c)
        self.c_fc, self.c_proj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    """GPT-2 as in nanoGPT: learned positions, pre-LN blocks, tied LM head, cross-entropy loss."""

    def __init__(self, m):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(m.vocab_size, m.n_embd), nn.Embedding(m.block_size, m.n_embd)
        self.blocks = nn.ModuleList(_Block(m.n_embd, m.n_head) for _ in range(m.n_layer))
        self.ln_f = nn.LayerNorm(m.n_embd)
        self.lm_head = nn.Linear(m.n_embd, m.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def plain_step(cfg):
    """A training step of PlainGPT with the config's dims and recipe (bench.reference_step)."""
    torch.manual_seed(cfg.train.seed)
    return reference_step(cfg, PlainGPT(cfg.model), lambda model, x, y: model(x, y))


def _single(kind: str, raw: dict, steps: int, warmup: int = 2) -> None:
    """In a fresh interpreter: time `steps` steps of one model; print one JSON line."""
    import resource
    from ..config import Config
    from ..parallel.grid import ParallelGrid
    from ..run.train import build, train_step
    torch.set_num_threads(1)
    cfg = Config.from_dict(raw)
    if kind == "megalite":
        tr = build(cfg, ParallelGrid.single(), torch.device("cpu"))
        step = lambda: train_step(tr)  # noqa: E731
    elif kind == "transformers":  # table 9: transformers' LlamaForCausalLM
        from .llama import _transformers_step
        step = _transformers_step(cfg)
    else:
        step = plain_step(cfg)
    times, cpu = [], []
    for i in range(warmup + steps):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    print(json.dumps({"times": times, "cpu": cpu,
                      "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def _raw(o: dict, layout, micro: int, batch: int, schedule: str = "1f1b") -> dict:
    tp, pp, dp = layout
    return {"model": o["model"], "parallel": {"tp": tp, "pp": pp, "dp": dp, "schedule": schedule},
            "train": {"global_batch_size": batch, "micro_batch_size": micro, "steps": 1000, "warmup_steps": 10,
                      "eval_batches": 1, "out_dir": o["work"]},
            "data": {"path": o["data"]}}


def _worker(rank: int, world: int, tmp: str, o: dict) -> None:
    from ..config import Config
    from ..parallel.grid import Layout, ParallelGrid
    from ..parallel.pipeline import SCHEDULES
    from ..run.train import build, train_step
    acc = [0.0]
    patch_dist(acc)
    out = {"bubble": [], "layouts": []}
    if o["bubble"]:
        grid = ParallelGrid.create(Layout(1, world, 1))
        for sched in ("1f1b", "afab"):
            for m in o["ms"]:
                tr = build(Config.from_dict(_raw(o, (1, world, 1), o["micro"], o["micro"] * m, sched)), grid,
                           torch.device("cpu"))
                inner = SCHEDULES[sched]
                SCHEDULES[sched] = stamped = _Stamped(inner, acc)
                try:
                    for _ in range(o["steps"] + 1):  # the first step warms up
                        train_step(tr)
                    mem = SavedBytes([p for _, p in tr.params])
                    with torch.autograd.graph.saved_tensors_hooks(mem.pack, mem.unpack):
                        train_step(tr)
                finally:
                    SCHEDULES[sched] = inner
                out["bubble"].append({"pp": world, "m": m, "schedule": sched, "stage": grid.coord.pp,
                                      "steps": stamped.steps[1:-1], "act_peak": mem.peak})
    for lay in o["layouts"]:
        grid = ParallelGrid.create(Layout(*lay))
        tr = build(Config.from_dict(_raw(o, lay, o["micro"], o["batch"])), grid, torch.device("cpu"))
        train_step(tr)
        times, comm = [], []
        for _ in range(o["steps"]):
            c0, t0 = acc[0], time.perf_counter()
            train_step(tr)
            times.append(time.perf_counter() - t0)
            comm.append(acc[0] - c0)
        out["layouts"].append({"layout": list(lay), "times": times, "comm": comm})
    everyone = agree.everyone(out)  # every rank's rows, on the job's default group
    if rank == 0:
        with open(os.path.join(tmp, f"train-{world}.json"), "w") as f:
            json.dump(everyone, f)


# ---------------------------------------------------------------- the driver
def layouts_of(world: int, n_head: int, n_layer: int, batch: int, micro: int) -> list[tuple]:
    out = []
    for dp in sorted((d for d in range(1, world + 1) if world % d == 0), reverse=True):
        for tp in (t for t in range(1, world // dp + 1) if (world // dp) % t == 0):
            pp = world // (dp * tp)
            if n_head % tp == 0 and pp <= n_layer and batch % (micro * dp) == 0:
                out.append((tp, pp, dp))
    return out


def _run_single(kind, raw, steps) -> dict:
    code = ("import json, sys; from megalite.bench.train import _single; "
            "_single(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]))")
    r = subprocess.run([sys.executable, "-c", code, kind, json.dumps(raw), str(steps)], capture_output=True,
                       text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if r.returncode:
        raise RuntimeError(f"bench train: the {kind} run failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def vs_plain(o: dict, pairs: int, log=print) -> list:
    """Table 1: megalite (1,1,1) and PlainGPT, each in a fresh interpreter, in `pairs` back-to-back pairs."""
    log(f"\n1. megalite (1,1,1) vs plain PyTorch (nanoGPT-style, torch.optim.AdamW), {pairs} pairs of fresh "
        f"processes, the order alternating; ratio = megalite / plain tokens/s within a pair, by the wall clock "
        f"and by the process's CPU time per step")
    return paired(o, "plain", _raw(o, (1, 1, 1), o["micro"], o["batch"]), pairs, _run_single, log)


def bench_train(steps: int = 10, nproc: int = 4, n_embd: int = 128, n_layer: int = 4, n_head: int = 4,
                block_size: int = 128, batch: int = 16, micro: int = 4, ms=(2, 4, 8), rounds: int = 2,
                pairs: int = 5,
                wait_ms: Optional[float] = None, workdir: Optional[str] = None, log=print,
                cp_seq: Optional[int] = None, llama_only: bool = False, families: bool = False) -> dict:
    """Run the benchmarks; print each table (via `log`) row by row as it is measured; return them as lists
    of dicts. wait_ms: t_f of the bubble table's wait rows (default: calibrated to the model); cp_seq: the
    sequence length of the context-parallel table (default 8 x block_size); pairs: table 1's
    megalite/plain pairs of fresh processes; rounds: the feature tables' alternating runs."""
    from ..data import default_corpus_files, prepare
    from ..testing import run_parallel
    model = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, vocab_size=256, dropout=0.0)
    tokens = batch * block_size
    out = {"single": [], "bubble": [], "layouts": []}
    work = tempfile.mkdtemp(prefix="megalite-bench-train-", dir=workdir)
    try:  # removed whatever happens, from the first line printed on (a closed pipe fails there)
        log(f"bench train: GPT {model}, global batch {batch} x {block_size} tokens, micro-batch {micro}, "
            f"{steps} timed steps after warm-up, 1 thread per process on {os.cpu_count()} cores (load average "
            f"{os.getloadavg()[0]:.1f} at the start)")
        data = os.path.join(work, "tok.bin")
        prepare(default_corpus_files(max_bytes=300_000), data, log=lambda *a: None)
        o = {"model": model, "data": data, "work": work, "steps": steps, "micro": micro, "batch": batch,
             "ms": list(ms), "bubble": True, "layouts": [], "wait_ms": wait_ms, "families": families}
        if llama_only:
            return bench_llama(o, nproc, pairs, _run_single, cp_seq or 8 * block_size, log=log)
        out["single"] = vs_plain(o, pairs, log)

        log("\n2. pipeline bubble: idle = 1 - busy / window (window: first stage's start to last stage's end; "
            "busy: schedule time outside torch.distributed), mean over stages, step with the shortest window; activations = peak bytes saved "
            "for backward per stage (stage 0 first)")
        t = StreamTable(["pp", "m", "schedule", "idle measured", "theory", "diff", "ms/step", "in flight (st.0)",
                         "saved activations MiB per stage"], [2, 1, 8, 13, 6, 6, 7, 16, 31], log=log)
        pps = sorted({p for p in (2, 4) if p <= min(nproc, n_layer)} | ({nproc} if 2 < nproc <= n_layer else set()))
        for w in sorted(set(pps) | {nproc}):
            lays = layouts_of(w, n_head, n_layer, batch, micro) if w == nproc else []
            run_parallel(_worker, w, tmp_dir=work, args=({**o, "bubble": w in pps, "layouts": lays},))
            with open(os.path.join(work, f"train-{w}.json")) as f:
                result = json.load(f)
            per = [x for rank in result for x in rank["bubble"]]
            for sched in ("1f1b", "afab") if w in pps else ():
                for m in ms:
                    rows = sorted((x for x in per if x["schedule"] == sched and x["m"] == m), key=lambda x: x["stage"])
                    r = {"pp": w, "m": m, "schedule": sched, **idle_of([x["steps"] for x in rows]),
                         "theory": (w - 1) / (m + w - 1), "in_flight": min(w, m) if sched == "1f1b" else m,
                         "act_peak_mib": [x["act_peak"] / 2**20 for x in rows]}
                    out["bubble"].append(r)
                    t.row([w, m, sched, f"{r['idle']:.1%}", f"{r['theory']:.1%}", f"{r['idle'] - r['theory']:+.1%}",
                           f"{r['step_ms']:.1f}", r["in_flight"], " / ".join(f"{x:.1f}" for x in r["act_peak_mib"])])
        log("\n3. layouts: comm = share of step time inside torch.distributed calls (mean over ranks)")
        t = StreamTable(["tp,pp,dp", "micro-batches", "tokens/s", "ms/step", "comm", "compute+other"], [8], log=log)
        for i, lay in enumerate(layouts_of(nproc, n_head, n_layer, batch, micro)):
            ranks = [rank["layouts"][i] for rank in result]
            step = statistics.median(max(r["times"][k] for r in ranks) for k in range(steps))
            comm = statistics.mean(sum(r["comm"]) / sum(r["times"]) for r in ranks)
            out["layouts"].append({"layout": tuple(lay), "micro_batches": batch // (micro * lay[2]),
                                   "tokens_per_s": tokens / step, "ms_per_step": step * 1000, "comm_frac": comm})
            t.row([",".join(map(str, lay)), batch // (micro * lay[2]), f"{tokens / step:,.0f}", f"{step * 1000:.1f}",
                   f"{comm:.1%}", f"{1 - comm:.1%}"])
        worlds = [w for w in sorted({2, nproc}) if n_head % w == 0 and block_size % w == 0 and w <= n_layer]
        out.update(bench_features({**o, "bucket_mb": 0.5, "rounds": rounds}, worlds, _run_single, log=log))
        out["context"] = bench_context(o, nproc, cp_seq or 8 * block_size, log=log)
        out.update(bench_llama(o, nproc, pairs, _run_single, cp_seq or 8 * block_size, log=log))
        out["zero"] = bench_zero(o, nproc, log=log)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out
