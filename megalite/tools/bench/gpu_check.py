"""launch/gpu-check.sh: one short check of a GPU machine (at most ~8 minutes on one GPU).

1. the chip's bf16 matmul rate (the MFU denominator), 2. GPT-2-124M (configs/gpt2-124m.toml) at (1,1,1) in
bf16 for a timed window: tokens/s and MFU, 3. checkpoints from device memory: a synchronous save, an
asynchronous save (pinned host staging; the stall is the time the step is blocked), a load back into a
fresh model, `verify`, and `convert` to one file, each compared with the live tensors; 4. exit 1 on any
mismatch. `--dry-run` does the same on the CPU with a tiny model in seconds (it runs in the test suite).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, seconds: float) -> float:
    """Dense (n x n) @ (n x n) rate in TFLOP/s: 2 n^3 flops per product, timed after a warm-up."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    iters, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ b
        iters += 10
        sync()
    return 2 * n ** 3 * iters / (time.perf_counter() - t0) / 1e12


def flops_per_token(m) -> float:
    """Training flops per token (PaLM appendix B): 6 N for the matmuls with N the non-embedding parameters
    plus the LM head, and 12 L h T for attention scores and values."""
    n = 12 * m.n_layer * m.n_embd ** 2 + m.vocab_size * m.n_embd
    return 6 * n + 12 * m.n_layer * m.n_embd * m.block_size


def _same(live: dict, other: dict, what: str, dtype=None) -> list:
    bad = []
    for name, t in live.items():
        o = other.get(name)
        want = t if dtype is None else t.to(dtype)
        if o is None or o.shape != want.shape or not torch.equal(o.cpu(), want.cpu()):
            bad.append(f"{what}: {name} differs")
    return bad


def run(dry_run: bool, config: str, window_s: float, out: Path, log=print) -> int:
    from ...config import load_config
    from ...data import default_corpus_files, prepare
    device = torch.device("cuda") if torch.cuda.is_available() and not dry_run else torch.device("cpu")
    if not dry_run and device.type != "cuda":
        log("gpu-check: no CUDA device visible (use --dry-run for the CPU rehearsal)")
        return 2
    log(f"gpu-check: {'DRY RUN on the CPU with a tiny model' if dry_run else torch.cuda.get_device_name()}")
    from . import StreamTable
    t = StreamTable(["check", "measured"], [48, 16], log=log)  # each row printed when measured
    n = 256 if dry_run else 8192
    peak = matmul_tflops(device, torch.bfloat16, n, 0.5 if dry_run else 10.0)
    t.row([f"1. bf16 matmul ({n}x{n})", f"{peak:.2f} TFLOP/s"])

    over = [f"--train.out_dir={out / 'run'}", "--train.precision=bf16", "--parallel.tp=1", "--parallel.pp=1",
            "--parallel.dp=1", f"--data.path={out / 'tokens.bin'}"]
    if dry_run:
        over += ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=64", "--model.block_size=32",
                 "--train.global_batch_size=4", "--train.micro_batch_size=2"]
    cfg = load_config(config, over)
    prepare(default_corpus_files(max_bytes=200_000 if dry_run else 2_000_000), out / "tokens.bin",
            log=lambda *a: None)
    import torch.distributed as dist
    if dist.is_initialized():
        return _checks(cfg, device, window_s, peak, out, t, log)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    from ...parallel.process_group import leave_distributed
    try:
        return _checks(cfg, device, window_s, peak, out, t, log)
    finally:
        leave_distributed()


def _checks(cfg, device: torch.device, window_s: float, peak: float, out: Path, t, log) -> int:
    """Steps 2 and 3 in a world of one (the process group is the caller's)."""
    from ...checkpoint import AsyncSaver, load_checkpoint, save_checkpoint
    from ...checkpoint.plan import collect
    from ...checkpoint.verify import verify
    from ...convert import convert
    from ...parallel.grid import Layout, ParallelGrid
    from ...testing import gather_full_model
    from ...train import build, train_step
    from safetensors.torch import load_file
    grid = ParallelGrid.create(Layout(1, 1, 1))
    tr = build(cfg, grid, device)
    train_step(tr)  # warm-up (allocations, kernels)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < window_s or steps < 2:
        rec = train_step(tr)
        steps += 1
    sync()
    dt = time.perf_counter() - t0
    tok_s = steps * cfg.train.global_batch_size * cfg.model.block_size / dt
    mfu = tok_s * flops_per_token(cfg.model) / (peak * 1e12)
    t.row([f"2. train {cfg.model.n_layer}x{cfg.model.n_embd} bf16 (1,1,1), {steps} steps in {dt:.1f} s",
           f"{tok_s:,.0f} tokens/s"])
    t.row(["2. MFU (6N + 12LhT flops/token vs step 1's rate)", f"{mfu:.1%}"])
    t.row(["2. loss after the window", f"{rec['loss']:.3f}"])
    if not math.isfinite(rec["loss"]):
        log("gpu-check: FAIL: the loss is not finite")
        return 1

    live = gather_full_model(tr.params, tr.grid)
    problems = []
    t0 = time.perf_counter()
    save_checkpoint(out / "ckpt-sync", tr.step, tr.model, tr.optimizer, grid, config=cfg.to_dict())
    t_sync = time.perf_counter() - t0
    t.row([f"3. sync save from {device.type} memory", f"{t_sync:.2f} s"])
    saver = AsyncSaver()
    t0 = time.perf_counter()  # as `megalite train` does at start-up: no save pays the allocation
    saver.reserve(collect(tr.params, tr.optimizer, grid, {}), tr.optimizer)
    t.row(["3. async buffers, allocated once at start-up", f"{time.perf_counter() - t0:.2f} s"])
    t0 = time.perf_counter()
    save_checkpoint(out / "ckpt-async", tr.step, tr.model, tr.optimizer, grid, config=cfg.to_dict(), saver=saver)
    stall = time.perf_counter() - t0
    saver.wait()
    t_async = time.perf_counter() - t0
    how = "pinned staging" if device.type == "cuda" else "held, no copy"
    t.row([f"3. async save stall ({how})", f"{stall * 1000:.0f} ms"])
    t.row(["3. async save until commit", f"{t_async:.2f} s"])
    fresh = build(cfg, grid, device)
    t0 = time.perf_counter()
    load_checkpoint(out / "ckpt-async", fresh.model, fresh.optimizer, grid)
    sync()
    t_load = time.perf_counter() - t0
    t.row(["3. load (async checkpoint)", f"{t_load:.2f} s"])
    problems += _same(live, gather_full_model(fresh.params, fresh.grid), "load")
    for root in ("ckpt-sync", "ckpt-async"):
        problems += [f"verify {root}: {p}" for p in verify(out / root)[1]]
    t0 = time.perf_counter()
    f32 = convert(out / "ckpt-sync", out / "model-fp32.safetensors", quiet=True)
    t_conv = time.perf_counter() - t0
    t.row(["3. convert to one fp32 file", f"{t_conv:.2f} s"])
    f16 = convert(out / "ckpt-async", out / "model-bf16.safetensors", dtype="bf16", quiet=True)
    problems += _same(live, load_file(f32), "convert fp32")
    problems += _same(live, load_file(f16), "convert bf16", dtype=torch.bfloat16)
    t.row(["3. verify both; load, fp32 and bf16 files vs live",
           "ok" if not problems else f"FAILED ({len(problems)})"])
    if problems:
        log("gpu-check: FAIL:\n  " + "\n  ".join(problems[:20]))
        return 1
    log("gpu-check: all checks passed")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="launch/gpu-check.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny model on the CPU (seconds)")
    p.add_argument("--config", default=str(Path(__file__).resolve().parents[3] / "configs" / "gpt2-124m.toml"))
    p.add_argument("--window", type=float, default=None, help="training window in seconds (default 120, dry 2)")
    p.add_argument("--dir", default=None, help="work folder (default: a temporary one, removed after)")
    a = p.parse_args(argv)
    window = a.window if a.window is not None else (2.0 if a.dry_run else 120.0)
    if a.dir:
        Path(a.dir).mkdir(parents=True, exist_ok=True)
        return run(a.dry_run, a.config, window, Path(a.dir))
    with tempfile.TemporaryDirectory(prefix="megalite-gpu-check-") as d:
        return run(a.dry_run, a.config, window, Path(d))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
