"""launch/gpu-check.sh: one short check of a GPU machine (at most ~8 minutes on one GPU).

1. the chip's bf16 matmul rate, 2. GPT-2-124M (configs/gpt2-124m.toml with GPT-2's padded vocab, 50304), or the
model of `--config` (configs/llama3-1b.toml: Llama-3.2-1B's dims, vocab 128256), at (1,1,1) in bf16 for a timed window, eager and with train.compile (`--compile both`, the default on a GPU):
tokens/s per GPU and MFU against the chip's datasheet dense bf16 peak (`PEAK_TFLOPS`; an unknown chip is
said to be unknown) with the MFU against step 1's measured rate beside it, 3. checkpoints from device memory: a synchronous save, an
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
import warnings
from pathlib import Path

import torch

from .. import models


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


# Datasheet dense (no 2:4 sparsity) bf16 tensor-core peaks, TFLOP/s, matched in this order against
# torch.cuda.get_device_name(): NVIDIA's H100 (SXM) and H200 datasheets give 1,979 with sparsity, so 989;
# the H100 PCIe 1,513 -> 756; the A100 (SXM and PCIe) 312.
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))


def datasheet_peak(name: str) -> tuple[str, float] | None:
    """(the table's chip, its dense bf16 peak in TFLOP/s) for a device name, or None for a chip not listed."""
    for chip, tflops in PEAK_TFLOPS:
        if chip.lower() in name.lower():
            return chip, tflops
    return None


def n_params(m) -> int:
    """Parameters that do matmul work per token (nanoGPT's get_num_params(non_embedding=True)): every
    parameter but the position table; the token embedding counts because it is the tied LM head (an untied
    Llama's lookup table does no matmul: its LM head counts instead, the same V x C).
    Llama: q and o (C x C), k and v (C x kv_heads * head_dim), gate, up and down (C x F), two RMSNorms."""
    C = m.n_embd
    f = m.spec.features
    if f.mlp == "swiglu":  # q, o (C x H*D), k, v (C x kv*D), gate, up, down, two RMSNorms; biases, q/k norms
        q, kv = m.n_head * m.head_dim, m.kv_heads * m.head_dim
        per_layer = 2 * C * q + 2 * C * kv + 3 * C * m.ffn_size + 2 * C
        per_layer += (q + 2 * kv) * f.qkv_bias + 2 * m.head_dim * f.qk_norm
        return m.n_layer * per_layer + m.vocab_size * C + C
    per_layer = 12 * C ** 2 + 13 * C  # qkv, proj, fc, fc-proj weights and biases, two LayerNorms
    return m.n_layer * per_layer + m.vocab_size * C + 2 * C


def flops_per_token(m, seq: int) -> float:
    """Training flops per token, as PaLM (appendix B) and nanoGPT's estimate_mfu count them: 6 N for the
    weight matmuls (2 forward + 4 backward per parameter) plus 12 L h T for attention's scores and values
    (h = the attention width n_head * head width; T = seq, the tokens a query attends over, at most a sliding
    window; causal masking not discounted)."""
    span = min(seq, m.sliding_window) if m.sliding_window else seq
    return 6 * n_params(m) + 12 * m.n_layer * m.n_head * m.head_dim * span


def _same(live: dict, other: dict, what: str, dtype=None) -> list:
    bad = []
    for name, t in live.items():
        o = other.get(name)
        want = t if dtype is None else t.to(dtype)
        if o is None or o.shape != want.shape or not torch.equal(o.cpu(), want.cpu()):
            bad.append(f"{what}: {name} differs")
    return bad


def run(dry_run: bool, config: str, window_s: float, out: Path, log=print, compile_modes=("off",),
        micro_batch: int | None = None) -> int:
    from ..config import load_config
    from ..data import default_corpus_files, prepare
    device = torch.device("cuda") if torch.cuda.is_available() and not dry_run else torch.device("cpu")
    if not dry_run and device.type != "cuda":
        log("gpu-check: no CUDA device visible (use --dry-run for the CPU rehearsal)")
        return 2
    name = "CPU" if dry_run else torch.cuda.get_device_name()
    log(f"gpu-check: {'DRY RUN on the CPU with a tiny model' if dry_run else name}")
    sheet = datasheet_peak(name)
    log("gpu-check: datasheet dense bf16 peak: " + (f"{sheet[1]:.0f} TFLOP/s ({sheet[0]})" if sheet else
        f"unknown for '{name}' (not in gpu_check.PEAK_TFLOPS): MFU against the measured matmul rate only"))
    from . import StreamTable
    t = StreamTable(["check", "measured"], [62, 18], log=log)  # each row printed when measured
    n = 256 if dry_run else 8192
    peak = matmul_tflops(device, torch.bfloat16, n, 0.5 if dry_run else 10.0)
    t.row([f"1. bf16 matmul ({n}x{n})", f"{peak:.2f} TFLOP/s"])

    over = [f"--train.out_dir={out / 'run'}", "--train.precision=bf16", "--parallel.tp=1", "--parallel.pp=1",
            "--parallel.dp=1", f"--data.path={out / 'tokens.bin'}"]
    if dry_run:
        over += ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=64", "--model.block_size=32",
                 "--model.vocab_size=256", "--train.global_batch_size=4", "--train.micro_batch_size=2",
                 "--train.seq_len=0", "--model.n_kv_head=0", "--model.intermediate_size=0"]  # (Llama's: defaults)
    if micro_batch and not dry_run:  # one GPU holds the whole global batch: fewer, larger micro-batches
        over += [f"--train.micro_batch_size={micro_batch}"]
    cfg = load_config(config, over)  # the config's own vocab: gpt2-124m.toml's 50304, llama3-1b.toml's 128256
    prepare(default_corpus_files(max_bytes=200_000 if dry_run else 2_000_000), out / "tokens.bin",
            log=lambda *a: None)
    import torch.distributed as dist
    peaks = (peak, sheet[1] if sheet else None)
    if dist.is_initialized():
        return _checks(cfg, device, window_s, peaks, out, t, log, compile_modes)
    from ..parallel.process_group import join, leave_distributed
    join("nccl" if device.type == "cuda" else "gloo")
    try:
        return _checks(cfg, device, window_s, peaks, out, t, log, compile_modes)
    finally:
        leave_distributed()


def _train_window(cfg, grid, device, window_s: float, peaks: tuple, t, label: str):
    """Step 2 for one train.compile setting: warm up, train for `window_s`, print its rows; the Trainer."""
    from ..config import seq_len
    from ..run.train import build, train_step
    tr = build(cfg, grid, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for _ in range(2 if cfg.train.compile else 1):  # warm-up: allocations, kernels (and the compilation)
        train_step(tr)
    sync()
    warm = time.perf_counter() - t0
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < window_s or steps < 2:
        rec = train_step(tr)
        steps += 1
    sync()
    dt = time.perf_counter() - t0
    tok_s = steps * cfg.train.global_batch_size * seq_len(cfg) / dt  # one GPU: tokens/s per GPU
    flops = tok_s * flops_per_token(cfg.model, seq_len(cfg))
    measured, sheet = peaks
    m = cfg.model
    t.row([f"2. {label}: warm-up ({'2 steps, compiling' if cfg.train.compile else '1 step'})", f"{warm:.1f} s"])
    family = "" if m.arch == models.DEFAULT else f"{m.arch.capitalize()} "  # GPT-2's rows read as they always did
    t.row([f"2. {label}: train {family}{m.n_layer}x{m.n_embd} V{m.vocab_size} bf16 (1,1,1), {steps} steps in {dt:.1f} s",
           f"{tok_s:,.0f} tokens/s/GPU"])
    t.row([f"2. {label}: MFU vs datasheet peak (6N + 12LhT flops/token)",
           f"{flops / (sheet * 1e12):.1%}" if sheet else "unknown chip"])
    t.row([f"2. {label}: MFU vs step 1's measured matmul", f"{flops / (measured * 1e12):.1%}"])
    t.row([f"2. {label}: loss after the window", f"{rec['loss']:.3f}"])
    return tr, rec


def _checks(cfg, device: torch.device, window_s: float, peaks: tuple, out: Path, t, log,
            compile_modes=("off",)) -> int:
    """Steps 2 and 3 in a world of one (the process group is the caller's)."""
    from ..checkpoint import AsyncSaver, load_checkpoint, save_checkpoint
    from ..checkpoint.plan import collect
    from ..checkpoint.verify import verify
    from ..convert import convert
    from ..parallel.grid import Layout, ParallelGrid
    from ..testing import gather_full_model
    from ..run.train import build
    from safetensors.torch import load_file
    grid = ParallelGrid.create(Layout(1, 1, 1))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tr = None
    for mode in compile_modes:
        del tr  # one model in memory at a time
        cfg.train.compile = mode == "on"
        tr, rec = _train_window(cfg, grid, device, window_s, peaks, t, "compiled" if mode == "on" else "eager")
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
    problems += flex_check(device, t)
    if problems:
        log("gpu-check: FAIL:\n  " + "\n  ".join(problems[:20]))
        return 1
    log("gpu-check: all checks passed")
    return 0


def flex_check(device: torch.device, t) -> list:
    """4. train.attn_backend = "flex" against "sdpa" on one Mistral-shaped model (GQA, a sliding window of T/4)
    with packed documents (about 8 a row): the loss and every gradient (the CPU: the loss only, torch's
    flex_attention having no backward there) within 1e-4 of the largest, and the step time of each (GPU)."""
    from ..config import ModelConfig
    from ..model import GPTStage
    from ..parallel.grid import ParallelGrid
    cuda = device.type == "cuda"
    B, T = (4, 2048) if cuda else (2, 64)
    cfg = ModelConfig(n_layer=2, n_head=8, n_embd=256, block_size=T, vocab_size=512, arch="mistral", n_kv_head=2,
                      sliding_window=T // 4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=g).to(device)
    docs = (torch.rand(B, T, generator=g) < 8 / T).cumsum(1).to(device)  # document ids, runs along each row
    out, problems = {}, []
    for backend in ("sdpa", "flex"):
        m = GPTStage(cfg, ParallelGrid.single(), attn_backend=backend).to(device)
        m.init_weights(7)

        def step():
            m.zero_grad(set_to_none=True)
            with torch.set_grad_enabled(cuda), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # flex unfused on the CPU says so
                loss = m(ids[:, :-1], ids[:, 1:], docs=docs)
            if cuda:
                loss.backward()
            return loss
        loss = step()  # the first: compiles flex
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(5 if cuda else 1):
            step()
        sync()
        out[backend] = (loss.item(), [p.grad for p in m.parameters()] if cuda else [],
                        (time.perf_counter() - t0) / (5 if cuda else 1))
        t.row([f"4. documents + window, {backend}: {'forward + backward' if cuda else 'forward'} "
               f"(B, T) = ({B}, {T})", f"{out[backend][2] * 1000:.1f} ms"])
    (ls, gs, _), (lf, gf, _) = out["sdpa"], out["flex"]
    if abs(ls - lf) > 1e-4 * abs(ls):
        problems.append(f"flex loss {lf} != sdpa loss {ls}")
    for a, b in zip(gs, gf):
        if (a - b).abs().max() > 1e-4 * a.abs().max():
            problems.append(f"flex gradient differs from sdpa's by {(a - b).abs().max():.2e}")
    t.row(["4. flex vs sdpa: loss" + (" and gradients" if cuda else " (CPU: no flex backward)"),
           "ok" if not problems else f"FAILED ({len(problems)})"])
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="launch/gpu-check.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny model on the CPU (seconds)")
    p.add_argument("--config", default=str(Path(__file__).resolve().parents[2] / "configs" / "gpt2-124m.toml"))
    p.add_argument("--window", type=float, default=None,
                   help="training window in seconds, per compile setting (default 60, dry 2)")
    p.add_argument("--compile", choices=("off", "on", "both"), default=None,
                   help="train.compile for step 2: both = an eager window, then a compiled one (default on a "
                        "GPU), off (default for --dry-run), on")
    p.add_argument("--dir", default=None, help="work folder (default: a temporary one, removed after)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="train.micro_batch_size on the GPU (default: the config's). At dp = 1 one GPU steps the "
                        "whole global batch: gpt2-124m.toml's 8 (sized for dp = 8) makes 8 small micro-batches; "
                        "64 makes one (docs/performance.md, On a GPU)")
    a = p.parse_args(argv)
    if a.micro_batch_size is not None and a.micro_batch_size < 1:
        p.error(f"--micro-batch-size {a.micro_batch_size}: expected a positive integer")
    window = a.window if a.window is not None else (2.0 if a.dry_run else 60.0)
    mode = a.compile or ("off" if a.dry_run else "both")
    modes = ("off", "on") if mode == "both" else (mode,)
    if a.dir:
        Path(a.dir).mkdir(parents=True, exist_ok=True)
        return run(a.dry_run, a.config, window, Path(a.dir), compile_modes=modes, micro_batch=a.micro_batch_size)
    with tempfile.TemporaryDirectory(prefix="megalite-gpu-check-") as d:
        return run(a.dry_run, a.config, window, Path(d), compile_modes=modes, micro_batch=a.micro_batch_size)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
