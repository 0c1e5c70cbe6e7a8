"""`python -m benchmarks.phases`: where a (1,1,1) step's time goes, megalite beside plain PyTorch.

Both models (megalite's GPTStage + ShardedAdamW, and bench.train.PlainGPT + torch.optim.AdamW) are built in
one process on one thread and step alternately on the same batch, so a drift in machine speed hits both;
each phase is timed per step and the medians after two warm-up steps are printed: forward + backward over the
micro-batches, the gradient finalize (megalite: dp mean and norm; plain: clip_grad_norm_) and the AdamW step.
`--fused-adamw off` times the elementwise AdamW (the default is megalite's: the fused kernel where torch has it).
docs/performance.md quotes its numbers.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch


def phases(steps: int = 30, n_layer: int = 4, n_embd: int = 128, block_size: int = 128, batch: int = 16,
           micro: int = 4, fused_adamw: str = "auto", log=print) -> dict:
    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="megalite-bench-phases-")
    try:  # the token file and the run folder go with it, whatever happens
        return _phases(work, steps, n_layer, n_embd, block_size, batch, micro, fused_adamw, log)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _phases(work: str, steps: int, n_layer: int, n_embd: int, block_size: int, batch: int, micro: int,
            fused_adamw: str, log) -> dict:
    from megalite.config import Config, num_microbatches
    from megalite.data import default_corpus_files, prepare
    from megalite.run.schedule import clip_scale
    from megalite.parallel.finalize import finalize_grads
    from megalite.parallel.grid import ParallelGrid
    from megalite.run.train import build, run_pipeline
    from megalite.bench import StreamTable
    from megalite.bench.train import PlainGPT
    data = os.path.join(work, "tok.bin")
    prepare(default_corpus_files(max_bytes=300_000), data, log=lambda *a: None)
    model_cfg = dict(n_layer=n_layer, n_head=4, n_embd=n_embd, block_size=block_size, vocab_size=256, dropout=0.0)
    cfg = Config.from_dict({"parallel": {"tp": 1, "pp": 1, "dp": 1}, "model": model_cfg, "data": {"path": data},
                            "train": {"global_batch_size": batch, "micro_batch_size": micro, "out_dir": work,
                                      "fused_adamw": fused_adamw}})
    m = num_microbatches(cfg)
    tr = build(cfg, ParallelGrid.single(), torch.device("cpu"))
    torch.manual_seed(cfg.train.seed)
    plain = PlainGPT(cfg.model)
    ps = list(plain.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in ps if p.dim() >= 2], "weight_decay": cfg.train.weight_decay},
                             {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}], lr=1e-3,
                            betas=(cfg.train.beta1, cfg.train.beta2), eps=1e-8)
    x, y = tr.sampler.next_batch()
    times: dict = {k: [] for k in ("megalite fwd+bwd", "megalite finalize", "megalite adamw",
                                   "plain fwd+bwd", "plain clip", "plain adamw")}

    def lap(key, t0):
        times[key].append(time.perf_counter() - t0)
        return time.perf_counter()

    for _ in range(steps + 2):
        t0 = time.perf_counter()
        tr.grads.zero()
        tr.grads.arm(m)
        run_pipeline(tr, x, y, train=True)
        t0 = lap("megalite fwd+bwd", t0)
        norm = finalize_grads(tr.params, tr.grads, tr.grid)
        t0 = lap("megalite finalize", t0)
        tr.optimizer.step(1e-3, grad_scale=clip_scale(norm, cfg.train.grad_clip))
        t0 = lap("megalite adamw", t0)
        opt.zero_grad(set_to_none=True)
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            (plain(xm, ym) / m).backward()
        t0 = lap("plain fwd+bwd", t0)
        torch.nn.utils.clip_grad_norm_(ps, cfg.train.grad_clip)
        t0 = lap("plain clip", t0)
        opt.step()
        lap("plain adamw", t0)
    med = {k: statistics.median(v[2:]) * 1000 for k, v in times.items()}
    t = StreamTable(["phase", "megalite ms", "plain ms", "megalite / plain"], [9, 11, 8, 16], log=log)
    for ours, theirs, name in (("megalite fwd+bwd", "plain fwd+bwd", "fwd+bwd"),
                               ("megalite finalize", "plain clip", "grad norm"),
                               ("megalite adamw", "plain adamw", "adamw")):
        t.row([name, f"{med[ours]:.1f}", f"{med[theirs]:.1f}", f"{med[ours] / med[theirs]:.3f}"])
    return med


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.phases", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--fused-adamw", default="auto", choices=("auto", "off", "on"))
    a = p.parse_args(argv)
    phases(a.steps, fused_adamw=a.fused_adamw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
