"""train(config): the training recipe, importable, with no argument parsing.

    build the grid -> build this rank's stage of the model -> init from the seed (full tensors, keep slice)
    -> per step: draw this dp rank's rows -> run the pipeline schedule over micro-batches
    -> sync tied embeddings over first/last stage -> average gradients over dp (buckets)
    -> clip by the global norm -> AdamW (ZeRO-1 optionally) -> log, eval, checkpoint
"""
from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import traceback
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from . import metrics
from .checkpoint.tree import step_dir
from .checkpointing import CheckpointManager
from .checkpoint.state import seed_everything
from .config import DEFAULT_DATA_PATH, Config, num_microbatches, seq_len, validate
from .faults import maybe_crash, slow_step
from .errors import USER_ERRORS, MegaliteError, one_line, DataError, NonFiniteError, StartupError  # noqa: F401 (re-exported)
from .data import (BatchSampler, TokenDataset, check_vocab, ensure_data, eval_batches, eval_tokens_per_byte,
                   tokenizer_of)
from .model import GPTStage
from .optim import grad_norm, lr_at
from .parallel.data import GradBuffer, ShardedAdamW
from .parallel.grid import Layout, ParallelGrid
from .parallel.pipeline import P2P, SCHEDULES, forward_only, interleaved, interleaved_forward_only
from .parallel.partition import partition_of
from .parallel.tensor import sync_sequence_parallel_grads
from .tokenizer import Tokenizer


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


def leave_distributed(error: Optional[BaseException] = None) -> None:
    """End this process's part in the job while the interpreter is still whole: destroy every process group
    (the grid's groups, newest first, then the default one) and free them now (all that nothing else still
    holds), so that their gloo worker threads are joined here. Left to interpreter exit, a worker thread
    still releasing its last collective's tensors (an all_gather_object's, say) needs the GIL after
    finalization began; Python ends such a thread with pthread_exit, whose unwinding through C++ aborts the
    process ("terminate called without an active exception", exit -6 instead of 2). After an `error`: no
    barrier first (a peer may be gone), and the locals of the error's finished frames (the grid, the
    Trainer) are dropped so the groups can be freed; the traceback itself stays printable."""
    if not dist.is_initialized():
        return
    try:
        if error is None:
            dist.barrier()  # leave together: a rank that exits while peers still talk to it can abort them
    finally:
        dist.destroy_process_group()  # every group torch knows, newest first
        e, seen = error, set()
        while e is not None and id(e) not in seen:  # the error, what it came from, and so on
            seen.add(id(e))
            traceback.clear_frames(e.__traceback__)
            e = e.__cause__ or e.__context__
        gc.collect()  # the grid's groups sit in reference cycles (an exception's frames): freed and joined here


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
    tokenizer: Optional[Tokenizer] = None  # the token file's, copied into every checkpoint
    val_tokens_per_byte: Optional[float] = None  # of the validation targets: val loss -> bits per byte

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
    par = cfg.parallel
    train_ds, val_ds = TokenDataset(cfg.data.path, "train"), TokenDataset(cfg.data.path, "val")
    check_vocab(train_ds, cfg.model.vocab_size)
    check_vocab(val_ds, cfg.model.vocab_size)
    tok = tokenizer_of(train_ds)  # carried by every checkpoint; rows past its vocab are never predicted
    model = GPTStage(cfg.model, grid, vpp=par.vpp, sp=par.sp, recompute=t.recompute,
                     real_vocab=tok.vocab_size).to(device)
    model.init_weights(t.seed)
    params = sorted(model.global_parameters(), key=lambda np_: np_[0])
    grads = GradBuffer([p for _, p in params], grid.dp, par.bucket_mb, overlap=par.overlap_grad_reduce)
    opt = ShardedAdamW(params, grid.tp, grid.dp, cfg.parallel.zero1, betas=(t.beta1, t.beta2),
                       weight_decay=t.weight_decay, bucket_mb=cfg.parallel.bucket_mb)
    c = grid.coord
    sampler = BatchSampler(train_ds, seq_len(cfg), t.global_batch_size, c.dp, grid.layout.dp, t.seed)
    val = eval_batches(val_ds, seq_len(cfg), t.global_batch_size, c.dp, grid.layout.dp,
                       t.eval_batches, t.seed)
    seed_everything(t.seed, grid)
    per_byte = eval_tokens_per_byte(val_ds, seq_len(cfg), t.global_batch_size, t.eval_batches, t.seed, tok)
    return Trainer(cfg, grid, device, model, params, grads, opt, sampler, val, tokenizer=tok,
                   val_tokens_per_byte=per_byte)


# ---------------------------------------------------------------- one step
def _micro(tensor: torch.Tensor, n: int, device) -> list:
    return [m.to(device) for m in tensor.chunk(n)]


def _run_pipeline(tr: Trainer, x, y, train: bool) -> float:
    """Schedule the micro-batches of (x, y) through the pipeline; return the global mean loss."""
    cfg, grid = tr.cfg, tr.grid
    m = num_microbatches(cfg)
    xs, ys = _micro(x, m, tr.device), _micro(y, m, tr.device)
    seq = seq_len(cfg) // (grid.tp.size if tr.model.sp else 1)  # sp: stages pass seq/tp positions
    shape = (cfg.train.micro_batch_size, seq, cfg.model.n_embd)
    p2p = P2P(grid, shape, torch.float32, tr.device) if grid.layout.pp > 1 else None
    vpp = len(tr.model.chunks)

    def stage_fn(inp, i, chunk=0):
        last = grid.is_last_stage and chunk == vpp - 1
        with tr.autocast():
            out = tr.model(inp, ys[i] if last else None, chunk=chunk)
        return out / m if last else out  # the mean over micro-batches is a sum of means / m

    tr.model.train(train)
    if vpp > 1 and train:
        losses = interleaved(stage_fn, xs, m, grid, p2p, vpp, all_warmup=cfg.parallel.schedule == "afab")
    elif vpp > 1:
        losses = interleaved_forward_only(stage_fn, xs, m, grid, p2p, vpp)
    elif train:
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
    tr.grads.arm(num_microbatches(cfg))  # overlap_grad_reduce: buckets reduce during the last backward
    loss = _run_pipeline(tr, x, y, train=True)
    slow_step(tr.step + 1)  # fault injection for tests (a slow step); a no-op unless MEGALITE_SLOW_STEP_S is set
    tr.grads.finish()  # the dp mean of every gradient bucket
    # The tied embedding has two copies (first and last stage): add their gradients so both step alike.
    if grid.embed.active and cfg.model.tie_embeddings:
        for _, p in tr.params:
            if partition_of(p).tied:
                dist.all_reduce(p.grad, group=grid.embed.group)
    if tr.model.sp:  # sequence parallelism: replicated parameters saw seq/tp of the tokens on each rank
        sync_sequence_parallel_grads([p for _, p in tr.params], grid.tp)
    norm = grad_norm(tr.params, grid)
    clip = cfg.train.grad_clip
    scale = clip / (norm + 1e-6) if clip > 0 and norm > clip else 1.0
    skipped = not (math.isfinite(loss) and math.isfinite(norm)) and _nonfinite(tr, loss, norm)
    if not skipped:
        tr.optimizer.step(lr, grad_scale=scale)
    tr.step += 1
    tokens = cfg.train.global_batch_size * seq_len(cfg)
    tr.tokens_seen += tokens
    dt = time.perf_counter() - t0
    return {"step": tr.step, "loss": loss, "lr": lr, "grad_norm": norm, "tokens_per_s": tokens / dt,
            "ms_per_step": dt * 1000, "tokens_seen": tr.tokens_seen, **({"skipped": True} if skipped else {})}


def _nonfinite(tr: Trainer, loss: float, norm: float) -> bool:
    """train.on_nonfinite: "skip" drops this step's update (the data moves on; said on rank 0) and returns
    True; "stop" raises NonFiniteError before the update, so no NaN ever reaches the weights or a checkpoint."""
    what = f"step {tr.step + 1}: loss {loss}, grad-norm {norm}"
    if tr.cfg.train.on_nonfinite == "skip":
        if tr.grid.rank == 0:
            print(f"WARNING: {what} is not finite; update skipped (train.on_nonfinite=skip)", flush=True)
        return True
    raise NonFiniteError(f"{what} is not finite; stopped before the update (train.on_nonfinite=stop; "
                         f"'skip' drops such steps). The last checkpoint saved stays `latest`")


def evaluate(tr: Trainer) -> float:
    with torch.no_grad():
        return sum(_run_pipeline(tr, x, y, train=False) for x, y in tr.val) / len(tr.val)


# ---------------------------------------------------------------- the loop
def _log_line(rec: dict, total: int, elapsed: float, done_steps: int) -> str:
    """`elapsed` covers `done_steps` steps after the first of this launch: the first step (start-up, lazy
    allocations, the first communicator set-up) is not representative, so no ETA is guessed from it."""
    eta = f"ETA {_fmt_time(elapsed / done_steps * (total - rec['step']))}" if done_steps > 0 else "ETA after step 2"
    val = f" | val {rec['val_loss']:.4f}" if "val_loss" in rec else ""
    val += f" ({rec['val_bpb']:.3f} bits/byte)" if "val_bpb" in rec else ""
    return (f"step {rec['step']:>5}/{total} | loss {rec['loss']:.4f}{val} | lr {rec['lr']:.2e} | "
            f"grad-norm {rec['grad_norm']:.3f} | {rec['tokens_per_s']:,.0f} tok/s | "
            f"{rec['ms_per_step']:.0f} ms/step | {eta}")


def _fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def prepare_data(cfg: Config, rank: int) -> None:
    """Build the default corpus once, on rank 0, if auto_prepare is on and the *default* path is missing.

    Any other missing path is a user error: a mistyped --data.path must not train on the stdlib sources.
    """
    path = Path(cfg.data.path)
    if cfg.data.auto_prepare and not path.exists():
        if path != Path(DEFAULT_DATA_PATH):
            raise DataError(f"data.path: token file '{path}' does not exist (data.auto_prepare builds only "
                            f"the default corpus at '{DEFAULT_DATA_PATH}'; run `megalite prepare FILES --out "
                            f"{path}` for your own text)")
        if rank == 0:
            ensure_data(path)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def train(cfg: Config, log=print, force: bool = False) -> Trainer:
    """Train per `cfg` on the current torchrun job (or one process); return the Trainer (its .history
    holds every step's metrics). `force`: a fresh start (checkpoint.resume=none) may move an earlier run's
    checkpoints in checkpoint.dir aside instead of refusing."""
    validate(cfg, world_size_from_env())
    par, t0 = cfg.parallel, time.perf_counter()
    progress(f"starting {par.tp * par.pp * par.dp} rank(s) (tp {par.tp}, pp {par.pp}, dp {par.dp}); joining the "
             f"process group...")
    device, _ = init_distributed(cfg.parallel.timeout_s)
    grid = ParallelGrid.create(Layout(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp),
                               timeout=timedelta(seconds=cfg.parallel.timeout_s))
    progress(f"{grid.layout.world_size} rank(s) joined in {time.perf_counter() - t0:.1f} s; building the model and "
             f"reading the data...")
    tr, ckpt = _start(cfg, grid, device, log, force)
    is_logger = grid.rank == 0
    metrics_file = metrics.open_for_run(Path(cfg.train.out_dir), tr.step, ckpt.resumed_event, log) \
        if is_logger else None
    if is_logger:
        log(f"megalite: {grid.layout} on {grid.layout.world_size} {device.type} process(es), "
            f"{num_microbatches(cfg)} micro-batches/step, schedule {cfg.parallel.schedule}, "
            f"zero1 {'on' if cfg.parallel.zero1 else 'off'}, precision {tr.precision}{_features(cfg)}")
    if tr.step >= cfg.train.steps and is_logger:
        log(f"megalite: this run already finished (step {tr.step}/{cfg.train.steps}, from {ckpt.resumed_path}); "
            f"nothing to train. To train further, raise --train.steps (the LR schedule then spans the new "
            f"total, see README), or start a new run with another --train.out_dir")
    start, t_first = tr.step, time.perf_counter()
    if tr.step < cfg.train.steps:
        progress(f"ready after {time.perf_counter() - t0:.1f} s; step {tr.step + 1} (the first step of a launch also "
                 f"sets up the communicators)...")
    ckpt.install_signal_handlers()
    try:
        while tr.step < cfg.train.steps:
            t_step = time.perf_counter()
            rec = train_step(tr)
            maybe_crash(tr.step, grid.rank)  # fault injection for tests; a no-op unless MEGALITE_CRASH_* is set
            if tr.step % cfg.train.eval_interval == 0 or tr.step == cfg.train.steps:
                rec["val_loss"] = evaluate(tr)
                if tr.val_tokens_per_byte:  # nats/token * tokens/byte / ln 2: one scale for every tokenizer
                    rec["val_bpb"] = rec["val_loss"] * tr.val_tokens_per_byte / math.log(2)
            tr.history.append(rec)
            if is_logger:
                metrics_file.write(json.dumps(rec) + "\n")
                metrics_file.flush()
                if tr.step == start + 1:
                    t_first = time.perf_counter()  # the ETA is timed from the end of the first step
                if tr.step % cfg.train.log_interval == 0 or tr.step == cfg.train.steps or tr.step == start + 1:
                    log(_log_line(rec, cfg.train.steps, time.perf_counter() - t_first, tr.step - start - 1))
            ckpt.note_step(time.perf_counter() - t_step, first=tr.step == start + 1)
            ckpt.after_step(tr)
            signum = ckpt.stop_requested()
            if signum or tr.step == cfg.train.stop_at_step:
                ckpt.finish(tr)
                tr.stopped_by = signal.Signals(signum).name if signum else "train.stop_at_step"
                if is_logger:
                    log(f"megalite: stopped by {tr.stopped_by} at step {tr.step}/{cfg.train.steps}"
                        f"{_resume_hint(cfg, ckpt.last_saved)}")
                break
        else:
            ckpt.finish(tr)
    except BaseException:
        log_traceback(Path(cfg.train.out_dir), grid.rank)
        raise
    finally:
        ckpt.restore_signal_handlers()
        ckpt.release()
        if metrics_file:
            metrics_file.close()
    return tr


def _resume_hint(cfg: Config, saved: int) -> str:
    """Where the stop left its checkpoint, and how to continue (rerunning the command resumes with the default
    checkpoint.resume=auto; a resume=PATH or =none run needs =auto instead)."""
    if not cfg.checkpoint.dir:
        return " (checkpoints are off: checkpoint.dir is empty; nothing was saved)"
    if saved <= 0:
        return f"; no checkpoint was saved in {cfg.checkpoint.dir}"
    again = ("run the same command again" if cfg.checkpoint.resume == "auto" else
             f"run the same command with --checkpoint.resume=auto instead of '{cfg.checkpoint.resume}'")
    # (after train.stop_at_step too: a resumed run starts past that step and trains on to train.steps)
    return f"; checkpoint {Path(cfg.checkpoint.dir) / step_dir(saved)}; to resume, {again}"


def _start(cfg: Config, grid: ParallelGrid, device, log, force: bool = False) -> tuple:
    """Data, model, the checkpoint folder's lock, resume: each phase agreed by all ranks (an error on any rank
    stops every rank there, before the next collective). A failure here leaves nothing behind."""
    def build_all():
        prepare_data(cfg, grid.rank)
        return build(cfg, grid, device), CheckpointManager(cfg, grid, log, force=force)

    tr, ckpt = agree(build_all, grid)
    explicit = cfg.checkpoint.resume not in ("", "none", "auto")
    if ckpt.root is not None and cfg.checkpoint.resume != "none" or explicit:
        progress(f"looking for a checkpoint to resume (checkpoint.resume={cfg.checkpoint.resume}) and loading it...")
    if explicit:  # only reads: done before anything is created or locked, so a bad PATH writes nothing
        agree(lambda: ckpt.resume(tr), grid)
    ckpt.check_writable(Path(cfg.train.out_dir))
    try:
        if not explicit:
            agree(lambda: ckpt.resume(tr), grid)  # resume=auto may finish an interrupted save: under the lock
        agree(lambda: ckpt.reserve(tr), grid)
    except BaseException:
        ckpt.abandon()
        raise
    return tr, ckpt


def progress(msg: str) -> None:
    """A start-up progress line from rank 0, on stderr: shown when stderr is a terminal (someone is watching a
    torchrun start) or MEGALITE_PROGRESS=1; never with MEGALITE_PROGRESS=0. Off in pipes and logs by default,
    so a start-up error stays the one line the error contract promises (README: "The error contract")."""
    want = os.environ.get("MEGALITE_PROGRESS", "")
    on = want == "1" if want in ("0", "1") else sys.stderr.isatty()
    if on and int(os.environ.get("RANK", "0")) == 0:
        print(f"megalite: {msg}", file=sys.stderr, flush=True)


def agree(fn, grid: ParallelGrid):
    """Run fn() on every rank; if a user error happens on any rank, every rank raises the lowest failing
    rank's error (marked shared, so only rank 0 prints it), instead of ranks dying one by one
    in different places. Anything else (a bug) keeps its own traceback."""
    result, err = None, None
    try:
        result = fn()
    except USER_ERRORS as e:
        err = e
    if grid.layout.world_size > 1:
        msgs = [None] * grid.layout.world_size
        dist.all_gather_object(msgs, None if err is None else (type(err).__name__, str(err)), group=grid.cpu)
        first = next((m for m in msgs if m is not None), None)
        if first is not None and err is None:
            err = StartupError(first[1])
    if err is not None:
        if isinstance(err, MegaliteError):
            err.everywhere()
        else:  # an OSError: say that every rank raises it
            err = StartupError(one_line(err))
        raise err
    return result


def log_traceback(out_dir: Path, rank: int) -> None:
    """Append the traceback of what ended a run to <out_dir>/errors.log (the one-line CLI error points
    here; MEGALITE_DEBUG=1 also prints it)."""
    try:
        if out_dir.is_dir():
            with open(out_dir / "errors.log", "a") as f:
                f.write(f"--- rank {rank}, {time.strftime('%Y-%m-%dT%H:%M:%S')}\n{traceback.format_exc()}")
    except OSError:
        pass


def _features(cfg: Config) -> str:
    """The memory/bubble features that are on, for the start-up line."""
    par, on = cfg.parallel, []
    if par.sp and par.tp > 1:
        on.append("sp")
    if par.vpp > 1:
        on.append(f"vpp {par.vpp} (interleaved)")
    if cfg.train.recompute != "none":
        on.append(f"recompute {cfg.train.recompute}")
    if par.overlap_grad_reduce and par.dp > 1:
        on.append("overlap_grad_reduce")
    return ", " + ", ".join(on) if on else ""
