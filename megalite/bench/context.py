"""`megalite bench train`, table 8: context parallelism (issue 22) beside tensor parallelism at one world size.

For one sequence length (`--cp-seq`) and the bench's model, each layout of `nproc` ranks with cp in {1, 2, 4}
(dp making up the rest) and tp in {2, 4} (the same world, no cp):

- saved activation bytes per rank of one layer and of its two regions apart (attention: ln_1 + attention +
  projection; MLP: ln_2 + fc + GELU + projection), measured with saved_tensors_hooks (SavedBytes: distinct
  non-parameter storages saved for backward), next to the formula, the adapted Korthikanti count of table 4
  (features.layer_activation_bytes) at s/cp tokens, whose two regions are (elements, fp32, dropout 0)
      attention  2sbh + 2sb + 4sbh/t + sba/t    (LN1 input and output, LN1 mean+rstd; q, k, v, output; lse)
      MLP        2sbh + 2sb + 8sbh/t           (LN2 input and output, LN2 mean+rstd; fc output, GELU output)
  Every term is linear in s (ring attention, like SDPA, saves q, k, v, its output and the log-sum-exp, never an
  s x s matrix), so a cp rank saves 1/cp of the cp = 1 bytes in each region. tp without sp cuts only the split
  terms, not the 2 sbh + 2 sb replicated in each region;
- tokens/s (median step, slowest rank) and the share of step time inside the cp ring's point-to-point hops
  (context.Ring.seconds: posting and waiting for the isend/irecv pairs) and inside any torch.distributed call.
"""
from __future__ import annotations

import json
import os
import statistics
import time

import torch

from ..parallel import agree
from . import SavedBytes, StreamTable, patch_dist
from .features import layer_activation_bytes


def cp_layouts(world: int, n_head: int, seq: int) -> list[tuple]:
    """(tp, pp, dp, cp) rows: cp = 1, 2, 4 with dp = world / cp, then tp = 2, 4 with dp = world / tp."""
    out = [(1, 1, world // cp, cp) for cp in (1, 2, 4) if world % cp == 0 and seq % (2 * cp) == 0]
    return out + [(tp, 1, world // tp, 1) for tp in (2, 4) if world % tp == 0 and n_head % tp == 0]


def _cfg(o: dict, layout):
    from ..config import Config
    tp, pp, dp, cp = layout
    return Config.from_dict({"model": {**o["model"], "block_size": o["seq"]},
                             "parallel": {"tp": tp, "pp": pp, "dp": dp, "cp": cp},
                             "train": {"global_batch_size": o["batch"], "micro_batch_size": 1, "steps": 1000,
                                       "warmup_steps": 10, "eval_batches": 1, "out_dir": o["work"]},
                             "data": {"path": o["data"]}})


def region_formula_bytes(s: int, b: int, h: int, a: int, t: int, bytes_per: int = 4) -> tuple[int, int]:
    """(attention, MLP) bytes one layer saves for backward (no recompute, no sp, dropout 0): the two regions of
    features.layer_activation_bytes("none", ...), which is their sum."""
    attn = 2 * s * b * h + 2 * s * b + 4 * s * b * h // t + s * b * a // t
    mlp = 2 * s * b * h + 2 * s * b + 8 * s * b * h // t
    return attn * bytes_per, mlp * bytes_per


def _layer_bytes(grid, cfg) -> tuple[int, int, int]:
    """Bytes one layer saves for backward on this rank for one sequence (its T/cp tokens): (the whole layer,
    its attention region, its MLP region), each from a forward of its own."""
    from ..model import GPTStage
    model = GPTStage(cfg.model, grid)
    model.init_weights(0)
    blk = model.blocks[str(model.layers[0])]
    regions = (lambda x: model.run_block(model.layers[0], x), lambda x: x + blk.attn(blk.ln_1(x)),
               lambda x: x + blk.mlp(blk.ln_2(x)))
    out = []
    for run in regions:
        x = torch.randn(1, cfg.model.block_size // grid.cp.size, cfg.model.n_embd,
                        generator=torch.Generator().manual_seed(1), requires_grad=True)
        mem = SavedBytes(list(model.parameters()))
        with torch.autograd.graph.saved_tensors_hooks(mem.pack, mem.unpack):
            y = run(x)
        y.sum().backward()  # every rank runs the same collectives, and the graph is freed
        out.append(mem.peak)
    return tuple(out)


def _worker(rank: int, world: int, tmp: str, o: dict) -> None:
    from ..run import train as train_mod
    from ..parallel.context import Ring
    from ..parallel.grid import Layout, ParallelGrid
    acc, out = [0.0], []
    patch_dist(acc)
    for lay in o["layouts"]:
        grid = ParallelGrid.create(Layout(*lay))
        cfg = _cfg(o, lay)
        saved = _layer_bytes(grid, cfg)
        tr = train_mod.build(cfg, grid, torch.device("cpu"))
        train_mod.train_step(tr)  # warm-up
        times, ring, comm = [], [], []
        for _ in range(o["steps"]):
            r0, c0, t0 = Ring.seconds, acc[0], time.perf_counter()
            train_mod.train_step(tr)
            times.append(time.perf_counter() - t0)
            ring.append(Ring.seconds - r0)
            comm.append(acc[0] - c0)
        out.append({"layout": list(lay), "saved": saved, "times": times, "ring": ring, "comm": comm})
    everyone = agree.everyone(out)  # every rank's rows, on the job's default group
    if rank == 0:
        with open(os.path.join(tmp, f"context-{world}.json"), "w") as f:
            json.dump(everyone, f)


def bench_context(o: dict, world: int, seq: int, log=print) -> list:
    """Table 8 for the bench's model at `world` ranks and sequence length `seq`; printed row by row."""
    from ..testing import run_parallel
    m = o["model"]
    h, a = m["n_embd"], m["n_head"]
    o = {**o, "seq": seq, "batch": world, "layouts": cp_layouts(world, a, seq)}
    log(f"\n8. context parallelism at {world} ranks: {seq}-token sequences, global batch {world} x {seq} tokens "
        f"(micro-batch 1 sequence); saved = bytes one layer (and its attention and MLP regions) keeps for backward "
        f"per rank for one sequence (saved_tensors_hooks) vs the table-4 formula at s/cp tokens; cp ring = share "
        f"of step time in the ring's isend/irecv (posting + waiting), comm = in any torch.distributed call (median "
        f"step, slowest rank)")
    run_parallel(_worker, world, tmp_dir=o["work"], args=(o,))
    with open(os.path.join(o["work"], f"context-{world}.json")) as f:
        result = json.load(f)
    t = StreamTable(["tp,pp,dp,cp", "saved KiB/rank", "formula KiB", "vs cp=1", "attn KiB", "(formula)",
                     "vs cp=1", "MLP KiB", "(formula)", "vs cp=1", "tokens/s", "ms/step", "cp ring", "comm"],
                    [11, 14, 11, 7, 8, 9, 7, 7, 9, 7, 8, 7, 7, 6], log=log)
    rows, base = [], None
    for i, lay in enumerate(o["layouts"]):
        tp, _, _, cp = lay
        ranks = [r[i] for r in result]
        step = statistics.median(max(r["times"][k] for r in ranks) for k in range(o["steps"]))
        ring = statistics.mean(sum(r["ring"]) / sum(r["times"]) for r in ranks)
        comm = statistics.mean(sum(r["comm"]) / sum(r["times"]) for r in ranks)
        saved, attn, mlp = ranks[0]["saved"]
        want = layer_activation_bytes("none", seq // cp, 1, h, a, tp, False)
        want_attn, want_mlp = region_formula_bytes(seq // cp, 1, h, a, tp)
        base = base or (saved, attn, mlp)
        row = {"layout": tuple(lay), "saved_bytes": saved, "formula_bytes": want, "saved_vs_cp1": saved / base[0],
               "attn_bytes": attn, "attn_formula_bytes": want_attn, "attn_vs_cp1": attn / base[1],
               "mlp_bytes": mlp, "mlp_formula_bytes": want_mlp, "mlp_vs_cp1": mlp / base[2],
               "tokens_per_s": world * seq / step, "ms_per_step": step * 1000, "cp_ring_frac": ring, "comm_frac": comm}
        rows.append(row)
        kib = lambda n: f"{n / 1024:.1f}"  # noqa: E731
        t.row([",".join(map(str, lay)), kib(saved), kib(want), f"{saved / base[0]:.3f}", kib(attn), kib(want_attn),
               f"{attn / base[1]:.3f}", kib(mlp), kib(want_mlp), f"{mlp / base[2]:.3f}",
               f"{row['tokens_per_s']:,.0f}", f"{step * 1000:.0f}", f"{ring:.1%}", f"{comm:.1%}"])
    log(f"host load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    return rows
