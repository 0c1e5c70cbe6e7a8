"""train(config): the training recipe, importable, with no argument parsing.

    build the grid -> build this rank's stage of the model -> init from the seed (full tensors, keep slice)
    -> per step: draw this dp rank's rows -> run the pipeline schedule over micro-batches
    -> sync tied embeddings over first/last stage -> average gradients over dp (buckets)
    -> clip by the global norm -> AdamW (ZeRO-1 optionally) -> log, eval, checkpoint
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from .checkpoint.manager import CheckpointManager
from .checkpoint.state import seed_everything
from .config import Config, num_microbatches, validate
from .faults import maybe_crash
from .data import BatchSampler, TokenDataset, ensure_data, eval_batches
from .model import GPTStage
from .optim import grad_norm, lr_at
from .parallel.data import GradBuffer, ShardedAdamW
from .parallel.grid import Layout, ParallelGrid
from .parallel.pipeline import P2P, SCHEDULES, forward_only
from .parallel.tensor import partition_of


# ---------------------------------------------------------------- process group
def init_distributed(timeout_s: float = 1800) -> tuple[torch.device, str]:
    """Join the torchrun job (or make a world of one); nccl with one GPU per rank, else gloo."""
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend, store=_job_store(rank, world, timeout_s), rank=rank,
                                    world_size=world, timeout=timedelta(seconds=timeout_s))
        else:  # a plain `megalite train` without torchrun: a world of one
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timedelta(seconds=timeout_s))
    return device, backend


def _job_store(rank: int, world: int, timeout_s: float):
    """torchrun's store, under a prefix per restart attempt.

    After `torchrun --max-restarts` restarts the workers, they reuse the agent's store, which still holds
    the previous attempt's gloo addresses; without a fresh namespace the new ranks try to connect to dead
    peers ("Connection refused") or hang.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(host, port, world, is_master=rank == 0 and not agent_store,
                          timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    if not agent_store:  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0 hosts a new store every attempt
        return store  # (restart counts differ between a restarted agent and a replaced one: pytorch#135712)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"megalite/attempt-{attempt}", store)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


# ---------------------------------------------------------------- what a run is made of
@dataclass
class Trainer:
    """Everything a step needs, built once by `build()`; checkpoints save and restore its state."""
    cfg: Config
    grid: ParallelGrid
    device: torch.device
    model: GPTStage
    params: list  # [(global name, parameter)] in a fixed order
    grads: GradBuffer
    optimizer: ShardedAdamW
    sampler: BatchSampler
    val: list
    step: int = 0
    tokens_seen: int = 0
    history: list = field(default_factory=list)
    stopped_by: Optional[str] = None

    @property
    def precision(self) -> str:
        p = self.cfg.train.precision
        return ("bf16" if self.device.type == "cuda" else "fp32") if p == "auto" else p

    def autocast(self):
        if self.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


def build(cfg: Config, grid: ParallelGrid, device: torch.device) -> Trainer:
    t = cfg.train
    model = GPTStage(cfg.model, grid).to(device)
    model.init_weights(t.seed)
    params = sorted(model.global_parameters(), key=lambda np_: np_[0])
    grads = GradBuffer([p for _, p in params], grid.dp, cfg.parallel.bucket_mb)
    opt = ShardedAdamW(params, grid.tp, grid.dp, cfg.parallel.zero1, betas=(t.beta1, t.beta2),
                       weight_decay=t.weight_decay, bucket_mb=cfg.parallel.bucket_mb)
    train_ds, val_ds = TokenDataset(cfg.data.path, "train"), TokenDataset(cfg.data.path, "val")
    c = grid.coord
    sampler = BatchSampler(train_ds, cfg.model.block_size, t.global_batch_size, c.dp, grid.layout.dp, t.seed)
    val = eval_batches(val_ds, cfg.model.block_size, t.global_batch_size, c.dp, grid.layout.dp,
                       t.eval_batches, t.seed)
    seed_everything(t.seed, grid)
    return Trainer(cfg, grid, device, model, params, grads, opt, sampler, val)


# ---------------------------------------------------------------- one step
def _micro(tensor: torch.Tensor, n: int, device) -> list:
    return [m.to(device) for m in tensor.chunk(n)]


def _run_pipeline(tr: Trainer, x, y, train: bool) -> float:
    """Schedule the micro-batches of (x, y) through the pipeline; return the global mean loss."""
    cfg, grid = tr.cfg, tr.grid
    m = num_microbatches(cfg)
    xs, ys = _micro(x, m, tr.device), _micro(y, m, tr.device)
    shape = (cfg.train.micro_batch_size, cfg.model.block_size, cfg.model.n_embd)
    p2p = P2P(grid, shape, torch.float32, tr.device) if grid.layout.pp > 1 else None

    def stage_fn(inp, i):
        with tr.autocast():
            out = tr.model(inp, ys[i] if grid.is_last_stage else None)
        return out / m if grid.is_last_stage else out  # the mean over micro-batches is a sum of means / m

    tr.model.train(train)
    if train:
        losses = SCHEDULES[cfg.parallel.schedule](stage_fn, xs, m, grid, p2p)
    else:
        losses = forward_only(stage_fn, xs, m, grid, p2p)
    # One number for every rank: the last stage's tp-rank-0 members contribute their dp share.
    total = torch.zeros(1, dtype=torch.float64)
    if grid.is_last_stage and grid.coord.tp == 0:
        total += sum(l.double().cpu() for l in losses).item() / grid.layout.dp
    if grid.world is not None and grid.layout.world_size > 1:
        dist.all_reduce(total, group=grid.cpu)
    return total.item()


def train_step(tr: Trainer) -> dict:
    cfg, grid = tr.cfg, tr.grid
    t0 = time.perf_counter()
    lr = lr_at(tr.step, cfg.train)
    x, y = tr.sampler.next_batch()
    tr.grads.zero()
    loss = _run_pipeline(tr, x, y, train=True)
    # The tied embedding has two copies (first and last stage): add their gradients so both step alike.
    if grid.embed.active:
        for _, p in tr.params:
            if partition_of(p).tied:
                dist.all_reduce(p.grad, group=grid.embed.group)
    tr.grads.all_reduce_mean()
    norm = grad_norm(tr.params, grid)
    clip = cfg.train.grad_clip
    scale = clip / (norm + 1e-6) if clip > 0 and norm > clip else 1.0
    tr.optimizer.step(lr, grad_scale=scale)
    tr.step += 1
    tokens = cfg.train.global_batch_size * cfg.model.block_size
    tr.tokens_seen += tokens
    dt = time.perf_counter() - t0
    return {"step": tr.step, "loss": loss, "lr": lr, "grad_norm": norm, "tokens_per_s": tokens / dt,
            "ms_per_step": dt * 1000, "tokens_seen": tr.tokens_seen}


def evaluate(tr: Trainer) -> float:
    with torch.no_grad():
        return sum(_run_pipeline(tr, x, y, train=False) for x, y in tr.val) / len(tr.val)


# ---------------------------------------------------------------- the loop
def _log_line(rec: dict, total: int, elapsed: float, done_steps: int) -> str:
    eta = elapsed / max(1, done_steps) * (total - rec["step"])
    val = f" | val {rec['val_loss']:.4f}" if "val_loss" in rec else ""
    return (f"step {rec['step']:>5}/{total} | loss {rec['loss']:.4f}{val} | lr {rec['lr']:.2e} | "
            f"grad-norm {rec['grad_norm']:.3f} | {rec['tokens_per_s']:,.0f} tok/s | "
            f"{rec['ms_per_step']:.0f} ms/step | ETA {_fmt_time(eta)}")


def _fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def prepare_data(cfg: Config, rank: int) -> None:
    """Build the default corpus once, on rank 0, if the configured file is missing and auto_prepare is on."""
    if cfg.data.auto_prepare and rank == 0 and not Path(cfg.data.path).exists():
        ensure_data(cfg.data.path)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def train(cfg: Config, log=print) -> Trainer:
    """Train per `cfg` on the current torchrun job (or one process); return the Trainer (its .history
    holds every step's metrics)."""
    validate(cfg, world_size_from_env())
    device, _ = init_distributed(cfg.parallel.timeout_s)
    grid = ParallelGrid.create(Layout(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp),
                               timeout=timedelta(seconds=cfg.parallel.timeout_s))
    prepare_data(cfg, grid.rank)
    tr = build(cfg, grid, device)
    ckpt = CheckpointManager(cfg, grid, log)
    ckpt.check_writable(Path(cfg.train.out_dir))
    ckpt.resume(tr)
    ckpt.reserve(tr)
    is_logger = grid.rank == 0
    metrics_file = _open_metrics(Path(cfg.train.out_dir), tr.step) if is_logger else None
    if is_logger:
        log(f"megalite: {grid.layout} on {grid.layout.world_size} {device.type} process(es), "
            f"{num_microbatches(cfg)} micro-batches/step, schedule {cfg.parallel.schedule}, "
            f"zero1 {'on' if cfg.parallel.zero1 else 'off'}, precision {tr.precision}")
    start, t_start = tr.step, time.perf_counter()
    ckpt.install_signal_handlers()
    try:
        while tr.step < cfg.train.steps:
            rec = train_step(tr)
            maybe_crash(tr.step, grid.rank)  # fault injection for tests; a no-op unless MEGALITE_CRASH_* is set
            if tr.step % cfg.train.eval_interval == 0 or tr.step == cfg.train.steps:
                rec["val_loss"] = evaluate(tr)
            tr.history.append(rec)
            if is_logger:
                metrics_file.write(json.dumps(rec) + "\n")
                metrics_file.flush()
                if tr.step % cfg.train.log_interval == 0 or tr.step == cfg.train.steps or tr.step == start + 1:
                    log(_log_line(rec, cfg.train.steps, time.perf_counter() - t_start, tr.step - start))
            ckpt.after_step(tr)
            signum = ckpt.stop_requested()
            if signum or tr.step == cfg.train.stop_at_step:
                ckpt.finish(tr)
                tr.stopped_by = signal.Signals(signum).name if signum else "train.stop_at_step"
                log_rank0 = log if is_logger else (lambda *a: None)
                where = f"; checkpoint {cfg.checkpoint.dir}" if cfg.checkpoint.dir else " (no checkpoint.dir set)"
                log_rank0(f"megalite: stopped by {tr.stopped_by} at step {tr.step}/{cfg.train.steps}{where}")
                break
        else:
            ckpt.finish(tr)
    finally:
        ckpt.restore_signal_handlers()
        ckpt.release()
        if metrics_file:
            metrics_file.close()
    return tr


def _open_metrics(out: Path, resumed_step: int):
    """metrics.jsonl: fresh runs start it anew; resumed runs keep the lines up to the resumed step."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "metrics.jsonl"
    kept = []
    if resumed_step and path.exists():
        kept = [line for line in path.read_text().splitlines() if line.strip()
                and json.loads(line).get("step", 0) <= resumed_step]
    f = open(path, "w")
    for line in kept:
        f.write(line + "\n")
    return f
