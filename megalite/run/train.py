"""train(config): the training recipe, importable, with no argument parsing.

    resolve and check the config -> join the torchrun job -> build the grid (parallel/process_group, grid)
    -> build this rank's stage of the model, init from the seed (full tensors, keep the slice)
    -> resume from a checkpoint (ckpt_policy.py: the loop's checkpoint policy)
    -> per step: draw this dp rank's rows (with cp: keep this rank's 2 of each sequence's 2cp chunks)
       -> run the pipeline schedule over the micro-batches (pipeline.py)
       -> finalize the gradients: dp x cp mean, tied embeddings, sp sync, global norm (parallel/finalize.py)
       -> clip -> AdamW (ZeRO-1 optionally) -> log, eval, checkpoint
"""
from __future__ import annotations

import contextlib
import json
import math
import signal
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ..attention import check_device
from ..base import faults
from . import metrics, tensorboard_log, wandb_log
from ..parallel.rng import seed_everything
from .ckpt_policy import CheckpointManager
from . import init_from
from .compile import compile_blocks
from ..config import DEFAULT_DATA_PATH, Config, ParallelConfig, num_microbatches, resolve, seq_len, settings, validate
from ..data import HASH_BITS, BatchSampler, ensure_data, identity as data_identity, token_hash
from ..data import mixture
from .inputs import open_data, open_evals
from ..base.errors import ConfigError, DataError, NonFiniteError
from ..base.origin import Origin
from ..model import GPTStage
from .schedule import clip_scale, lr_at
from ..parallel.context import local_positions, split_sequence
from ..parallel.tensor import vocab_parallel_cross_entropy
from ..parallel.data import GradBuffer, ShardedAdamW, use_fused
from ..parallel.finalize import finalize_grads
from ..parallel.zero import ShardedState
from ..parallel.grid import ParallelGrid
from ..parallel.pipeline import P2P, get_schedule
from ..parallel.agree import agree, agree_settings
from ..parallel.process_group import joined, world_size_from_env
from .runlog import log_traceback, progress, start_line, step_line, stop_line
from ..tokenizer import Tokenizer


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
    sampler: BatchSampler | mixture.MixtureSampler
    val: list
    step: int = 0
    tokens_seen: int = 0
    history: list = field(default_factory=list)
    stopped_by: Optional[str] = None
    tokenizer: Optional[Tokenizer] = None  # the token file's, copied into every checkpoint
    origin: Optional[Origin] = None  # the model's source's tokenizer files, dtype, ids (base/origin.py): carried on
    val_tokens_per_byte: Optional[float] = None  # of the validation targets: val loss -> bits per byte
    evals: list = field(default_factory=list)  # data.eval: (name, fixed batches, tokens per byte) of each set

    @property
    def precision(self) -> str:
        p = self.cfg.train.precision
        return ("bf16" if self.device.type == "cuda" else "fp32") if p == "auto" else p

    def autocast(self):
        if self.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


def build(cfg: Config, grid: ParallelGrid, device: torch.device) -> Trainer:
    t, par = cfg.train, cfg.parallel
    # the tokenizer is carried by every checkpoint; rows past its vocab are never predicted
    sampler, val, per_byte, tok = open_data(cfg, grid.coord.dp, grid.layout.dp)
    evals = open_evals(cfg, grid.coord.dp, grid.layout.dp, tok)
    check_device(t.attn_backend, device)
    model = GPTStage(cfg.model, grid, vpp=par.vpp, sp=par.sp, recompute=t.recompute,
                     real_vocab=tok.vocab_size, attn_backend=t.attn_backend).to(device)
    model.init_weights(t.seed)
    if t.compile:
        compile_blocks(model)
    params = sorted(model.global_parameters(), key=lambda np_: np_[0])
    # cp ranks hold the same weights as dp replicas do: gradients are averaged, and ZeRO cuts, over dp x cp
    if par.zero_level >= 2 and grid.dp_cp.active:  # each block one unit (gathered, reduced together): parallel/zero.py
        shard, replicate = grid.hybrid(par.dp_shard)  # dp_shard: cut within groups, all-reduced across them
        grads = ShardedState(params, list(model.blocks.values()), model, grid.tp, shard, par.zero_level,
                             par.reshard_after_forward, par.overlap_grad_reduce, replicate)
    else:
        grads = GradBuffer([p for _, p in params], grid.dp_cp, par.bucket_mb, overlap=par.overlap_grad_reduce)
    opt = ShardedAdamW(params, grid.tp, grads.dp, zero=par.zero_level, betas=(t.beta1, t.beta2), shards=grads,
                       weight_decay=t.weight_decay, bucket_mb=par.bucket_mb, fused=use_fused(t.fused_adamw, device))
    seed_everything(t.seed, grid)
    return Trainer(cfg, grid, device, model, params, grads, opt, sampler, val, tokenizer=tok,
                   val_tokens_per_byte=per_byte, evals=evals)


# ---------------------------------------------------------------- one step
def token_weighted_loss(tr: Trainer, logits, targets, mask, counted: int):
    """This rank's share of the global batch's loss, from one micro-batch's logits (b, t, V/tp): the sum of its
    per-token losses over the counted targets (`mask` 1; None: all), / `counted` (the counted targets of the
    whole global batch), x dp * cp (the gradient reduction over dp x cp averages the replicas' shares, so the
    average of these is the global sum / counted). Summed over micro-batches and ranks it is the mean over
    the counted tokens of the whole global batch: the same at every layout and micro-batch split, however
    unevenly the counted tokens fall (never a mean of per-micro-batch means). A masked target's gradient is
    exactly zero (its loss is multiplied by 0); a global batch with nothing counted has loss 0."""
    m = tr.model
    per_token = vocab_parallel_cross_entropy(logits, targets, m.cfg.vocab_size, m.tp, m.real_vocab)  # (b, t)
    if mask is not None:
        per_token = per_token * mask
    return per_token.sum() * (tr.grid.layout.replicas / max(counted, 1))


def run_pipeline(tr: Trainer, x, y, train: bool, mask=None, counted: int | None = None, docs=None) -> float:
    """Schedule the micro-batches of (x, y) through the pipeline; return the global mean loss over the counted
    targets (`mask`, `counted`: data.Batch's); `docs` (data.document_mask): each input's document."""
    return _pipeline(tr, x, y, train, mask, counted, docs)[0]


def _pipeline(tr: Trainer, x, y, train: bool, mask=None, counted: int | None = None, docs=None) -> tuple[float, int]:
    """run_pipeline, also returning the global batch's hash when `train` (else 0): what `batch_hash` records."""
    cfg, grid = tr.cfg, tr.grid
    m = num_microbatches(cfg)
    counted = cfg.train.global_batch_size * seq_len(cfg) if counted is None else counted
    x, y = split_sequence(x, grid.cp), split_sequence(y, grid.cp)  # cp: this rank's chunks of every sequence
    masks = [None] * m if mask is None else [t.to(tr.device) for t in split_sequence(mask, grid.cp).chunk(m)]
    # every stage drew the batch, so each knows its micro-batches' documents: nothing travels with the activations
    docs = [None] * m if docs is None or not cfg.data.document_mask else [t.to(tr.device) for t in docs.chunk(m)]
    # The batch hash, from the ids this rank really feeds: the inputs as the first stage, the targets as the
    # last, each token keyed by its global row and position (data.token_hash), so every layout sums the same.
    share = 0
    if train and grid.coord.tp == 0 and (grid.is_first_stage or grid.is_last_stage):
        rows = grid.coord.dp * x.shape[0] + np.arange(x.shape[0])
        pos = local_positions(seq_len(cfg), grid.cp).numpy()
        share = (token_hash(x.numpy(), rows, pos, 0) if grid.is_first_stage else 0) \
            + (token_hash(y.numpy(), rows, pos, 1) if grid.is_last_stage else 0)
    xs, ys = ([t.to(tr.device) for t in batch.chunk(m)] for batch in (x, y))
    seq = seq_len(cfg) // grid.cp.size // (grid.tp.size if tr.model.sp else 1)  # sp: stages pass seq/(cp tp) positions
    shape = (cfg.train.micro_batch_size, seq, cfg.model.n_embd)
    p2p = P2P(grid, shape, torch.float32, tr.device) if grid.layout.pp > 1 else None
    vpp = len(tr.model.chunks)

    def stage_fn(inp, i, chunk=0):
        last = grid.is_last_stage and chunk == vpp - 1
        with tr.autocast():
            out = tr.model(inp, None, chunk=chunk, docs=docs[i])  # the last chunk: logits (b, t, V/tp)
            return token_weighted_loss(tr, out, ys[i], masks[i], counted) if last else out

    tr.model.train(train)
    losses = get_schedule(cfg.parallel.schedule, vpp, train)(stage_fn, xs, m, grid, p2p)
    # One number for every rank: the last stage's tp-rank-0 members contribute their dp x cp share (a cp rank's
    # loss is the mean over its T/cp tokens of each sequence: the mean of the cp means is the mean over all T).
    # The hash shares ride along in the same all-reduce (exact in float64: see data.token_hash).
    total = torch.tensor([0.0, float(share)], dtype=torch.float64)
    if grid.is_last_stage and grid.coord.tp == 0:
        total[0] += sum(l.double().cpu() for l in losses).item() / grid.layout.replicas
    if grid.world is not None and grid.layout.world_size > 1:
        dist.all_reduce(total, group=grid.cpu)
    return total[0].item(), int(total[1].item()) % (1 << HASH_BITS)


def train_step(tr: Trainer) -> dict:
    """One optimizer step: the batch through the pipeline, every gradient finalized (one call), the update."""
    cfg, t0 = tr.cfg, time.perf_counter()
    lr = lr_at(tr.step, cfg.train)
    batch = tr.sampler.next_batch()
    tr.grads.zero()
    tr.grads.arm(num_microbatches(cfg))  # overlap_grad_reduce: buckets reduce during the last backward
    loss, digest = _pipeline(tr, batch.x, batch.y, True, batch.mask, batch.counted, batch.docs)
    norm = finalize_grads(tr.params, tr.grads, tr.grid, sp=tr.model.sp)
    skipped = not (math.isfinite(loss) and math.isfinite(norm)) and _nonfinite(tr, loss, norm)
    if not skipped:
        tr.optimizer.step(lr, grad_scale=clip_scale(norm, cfg.train.grad_clip))
    tr.step += 1
    tokens = cfg.train.global_batch_size * seq_len(cfg)
    tr.tokens_seen += tokens
    dt = time.perf_counter() - t0
    return {"step": tr.step, "loss": loss, "lr": lr, "grad_norm": norm, "tokens_per_s": tokens / dt,
            "ms_per_step": dt * 1000, "tokens_seen": tr.tokens_seen, "batch_hash": f"{digest:08x}",
            **({"skipped": True} if skipped else {})}


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


def evaluate(tr: Trainer, batches: Optional[list] = None) -> float:
    """The mean loss over fixed batches (default: the validation batches)."""
    batches = tr.val if batches is None else batches
    with torch.no_grad():
        return sum(run_pipeline(tr, b.x, b.y, False, b.mask, b.counted, b.docs) for b in batches) / len(batches)


# ---------------------------------------------------------------- the run
def train(cfg: Config, log=print, force: bool = False) -> Trainer:
    """Train per `cfg` on the current torchrun job (or one process); return the Trainer (its .history
    holds every step's metrics). `force`: a fresh start (checkpoint.resume=none) may move an earlier run's
    checkpoints in checkpoint.dir aside instead of refusing."""
    world = world_size_from_env()
    problem = None
    try:
        init_from.adopt(cfg)  # train.init_from: the source's [model] section, before anything checks it
        validate(resolve(cfg, world), world)
    except ConfigError as e:
        if world == 1:
            raise
        problem = e  # said after the ranks compared their settings: another rank may hold the right value
    par, t0 = cfg.parallel, time.perf_counter()
    cp = f"cp {par.cp}, " if par.cp != 1 else ""
    progress(f"starting {world} rank(s) (tp {par.tp}, {cp}pp {par.pp}, dp {par.dp}); joining the process group...")
    with joined(par.timeout_s if problem is None else ParallelConfig.timeout_s) as device:  # left when train ends
        return _run(cfg, world, problem, device, t0, log, force)


def _run(cfg: Config, world: int, problem, device, t0: float, log, force: bool) -> Trainer:
    """train() inside the joined job: agree, build the grid, start, loop."""
    par = cfg.parallel
    if world > 1:  # every rank runs the same settings, or none starts: before anything is read or written
        files = {f"data.mixture[{i}] (token file)": data_identity(e["path"]) for i, e in enumerate(cfg.data.mixture)
                 if isinstance(e, dict) and isinstance(e.get("path"), str)} or \
            {"data.path (token file)": data_identity(cfg.data.path)}
        files.update({f"data.eval[{i}] (token file)": data_identity(e["path"]) for i, e in enumerate(cfg.data.eval)
                      if isinstance(e, dict) and isinstance(e.get("path"), str)})
        agree_settings({**settings(cfg), **files}, problem)
    grid = ParallelGrid.create(par.layout, timeout=timedelta(seconds=par.timeout_s))
    progress(f"{grid.layout.world_size} rank(s) joined in {time.perf_counter() - t0:.1f} s; building the model and "
             f"reading the data...")
    tr, ckpt, metrics_file = _start(cfg, grid, device, log, force)
    board = _Boards(tensorboard_log.Board(Path(cfg.train.out_dir), tr.step)
                    if grid.rank == 0 and cfg.train.tensorboard else None,
                    wandb_log.WandbRun(cfg, tr.step) if grid.rank == 0 and cfg.train.wandb else None)
    if grid.rank == 0:
        log(start_line(cfg, grid.layout, device.type, tr.precision))
        if cfg.data.mixture:
            log(f"data: a mixture of {len(tr.sampler.sources)} sources: {tr.sampler.shares()}")
        if tr.step >= cfg.train.steps:
            log(f"megalite: this run already finished (step {tr.step}/{cfg.train.steps}, from {ckpt.resumed_path}); "
                f"nothing to train. To train further, raise --train.steps (the LR schedule then spans the new "
                f"total, see README), or start a new run with another --train.out_dir")
    if tr.step < cfg.train.steps:
        progress(f"ready after {time.perf_counter() - t0:.1f} s; step {tr.step + 1} (the first step of a launch also "
                 f"sets up the communicators)...")
    ckpt.install_signal_handlers()
    try:
        _loop(tr, ckpt, log, metrics_file, board)
    except BaseException:
        log_traceback(Path(cfg.train.out_dir), grid.rank)
        raise
    finally:
        ckpt.restore_signal_handlers()
        ckpt.release()
        if metrics_file:
            metrics_file.close()
        if board:
            board.close()
    return tr


class _Boards:
    """TensorBoard and W&B, either or both (or neither: falsy), written and closed together."""

    def __init__(self, *boards):
        self.boards = [b for b in boards if b is not None]

    def __bool__(self) -> bool:
        return bool(self.boards)

    def write(self, rec: dict) -> None:
        for b in self.boards:
            b.write(rec)

    def close(self) -> None:
        for b in self.boards:
            b.close()


def _loop(tr: Trainer, ckpt: CheckpointManager, log, metrics_file, board=None) -> None:
    """Steps until train.steps, a stop signal or train.stop_at_step; each logged (rank 0: `metrics_file`,
    and `board` with train.tensorboard),
    evaluated on schedule and offered to the checkpoint policy."""
    t = tr.cfg.train
    start, t_first = tr.step, time.perf_counter()
    stop_at = t.stop_at_step if t.stop_at_step > start else 0
    while tr.step < t.steps:
        t_step = time.perf_counter()
        rec = train_step(tr)
        faults.step_end(tr.step, tr.grid.rank)  # test hooks (a crash, a slow step): no-ops unless asked for
        if tr.step % t.eval_interval == 0 or tr.step == t.steps:
            rec["val_loss"] = evaluate(tr)
            if tr.val_tokens_per_byte:  # nats/token * tokens/byte / ln 2: one scale for every tokenizer
                rec["val_bpb"] = rec["val_loss"] * tr.val_tokens_per_byte / math.log(2)
            for name, batches, per_byte in tr.evals:  # data.eval's named sets
                rec[f"eval/{name}/loss"] = evaluate(tr, batches)
                if per_byte:
                    rec[f"eval/{name}/bpb"] = rec[f"eval/{name}/loss"] * per_byte / math.log(2)
        tr.history.append(rec)
        if metrics_file:
            metrics_file.write(json.dumps(rec) + "\n")
            metrics_file.flush()
            if board:
                board.write(rec)
            if tr.step == start + 1:
                t_first = time.perf_counter()  # the ETA is timed from the end of the first step
            if tr.step % t.log_interval == 0 or tr.step in (t.steps, start + 1, stop_at):
                log(step_line(rec, t.steps, time.perf_counter() - t_first, tr.step - start - 1, stop_at,
                              bpb=tr.tokenizer is not None and not tr.tokenizer.is_byte))
        ckpt.note_step(time.perf_counter() - t_step, first=tr.step == start + 1)
        ckpt.after_step(tr)
        signum = ckpt.stop_requested()
        if signum or tr.step == t.stop_at_step:
            ckpt.finish(tr)
            tr.stopped_by = signal.Signals(signum).name if signum else "train.stop_at_step"
            if tr.grid.rank == 0:
                log(stop_line(tr.cfg, tr.stopped_by, tr.step, ckpt.last_saved))
            return
    ckpt.finish(tr)


def refuse_start(error: BaseException) -> None:
    """A rank whose config did not load (a config file that differs between hosts) still joins the job and
    says why, so that no other rank waits for it until the process-group timeout: every rank raises it."""
    with joined(ParallelConfig.timeout_s):
        agree_settings(None, error)


def prepare_data(cfg: Config, rank: int) -> None:
    """Build the default corpus once, on rank 0, if auto_prepare is on and the *default* path is missing.

    Any other missing path is a user error: a mistyped --data.path must not train on the stdlib sources.
    Without auto_prepare, a missing default corpus is one line naming the flag that builds it.
    """
    path = Path(cfg.data.path)
    if cfg.data.mixture:  # the mixture's token files are prepared by the user; data.path is not read
        return
    if path == Path(DEFAULT_DATA_PATH) and not cfg.data.auto_prepare and not path.exists() and not path.is_symlink():
        raise DataError(f"data.path: token file '{path}' does not exist: add --data.auto_prepare=true to build the "
                        f"default corpus there from the Python standard library's sources, or point --data.path "
                        f"at a file `megalite prepare FILES --out PATH` wrote")
    if cfg.data.auto_prepare and not path.exists():
        if path != Path(DEFAULT_DATA_PATH):
            raise DataError(f"data.path: token file '{path}' does not exist (data.auto_prepare builds only "
                            f"the default corpus at '{DEFAULT_DATA_PATH}'; run `megalite prepare FILES --out "
                            f"{path}` for your own text)")
        if rank == 0:
            ensure_data(path)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _start(cfg: Config, grid: ParallelGrid, device, log, force: bool = False) -> tuple:
    """Data, model, the checkpoint folder's lock, resume: each phase agreed by all ranks (an error on any rank
    stops every rank there, before the next collective). A failure here leaves nothing behind."""
    out_dir = Path(cfg.train.out_dir)

    def build_all():
        if cfg.train.tensorboard and grid.rank == 0:
            tensorboard_log.require()  # before anything is written
            tensorboard_log.check_path(out_dir)  # a symlink or a file there: refused before anything is written
        if cfg.train.wandb and grid.rank == 0:
            tensorboard_log.check_path(out_dir, "wandb", "W&B")  # as tensorboard/: never written through
            wandb_log.require(cfg)
        if grid.rank == 0:
            metrics.check_path(out_dir)  # a symlink or a FIFO there: refused before anything is written
        prepare_data(cfg, grid.rank)
        return build(cfg, grid, device), CheckpointManager(cfg, grid, log, force=force)

    tr, ckpt = agree(build_all, grid)
    explicit = cfg.checkpoint.resume not in ("", "none", "auto")
    if ckpt.root is not None and cfg.checkpoint.resume != "none" or explicit:
        progress(f"looking for a checkpoint to resume (checkpoint.resume={cfg.checkpoint.resume}) and loading it...")
    if explicit:  # only reads: done before anything is created or locked, so a bad PATH writes nothing
        agree(lambda: ckpt.resume(tr), grid)
    ckpt.check_writable(out_dir)
    try:
        if not explicit:
            agree(lambda: ckpt.resume(tr), grid)  # resume=auto may finish an interrupted save: under the lock
        if cfg.train.init_from and ckpt.resumed_path is None:  # this run's own checkpoints take precedence
            progress(f"reading the weights of train.init_from={cfg.train.init_from}...")
            tr.origin = agree(lambda: init_from.load(tr, cfg.train.init_from), grid)
            if grid.rank == 0:
                log(f"initialised from {cfg.train.init_from} (its weights; a fresh optimizer and LR schedule "
                    f"from step 1)")
        agree(lambda: ckpt.reserve(tr), grid)
        metrics_file = agree(lambda: metrics.open_for_run(out_dir, tr.step, ckpt.resumed_event, log)
                             if grid.rank == 0 else None, grid)
    except BaseException:
        ckpt.abandon()
        raise
    return tr, ckpt, metrics_file
