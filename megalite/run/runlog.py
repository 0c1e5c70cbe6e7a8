"""What a training run tells the person watching it: start-up progress, the start line, one line per logged
step (with an honest ETA), the stop line with how to resume, and the traceback kept in errors.log.

Only rank 0 speaks (the caller decides for the lines it logs; `progress` checks RANK itself). The per-step
records themselves are metrics.py's (metrics.jsonl).
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

from ..base.fs import open_append
from ..checkpoint.tree import step_dir
from ..config import Config, num_microbatches


def progress(msg: str) -> None:
    """A start-up progress line from rank 0, on stderr: shown when stderr is a terminal (someone is watching a
    torchrun start) or MEGALITE_PROGRESS=1; never with MEGALITE_PROGRESS=0. Off in pipes and logs by default,
    so a start-up error stays the one line the error contract promises (README: "The error contract")."""
    want = os.environ.get("MEGALITE_PROGRESS", "")
    on = want == "1" if want in ("0", "1") else sys.stderr.isatty()
    if on and int(os.environ.get("RANK", "0")) == 0:
        print(f"megalite: {msg}", file=sys.stderr, flush=True)


def log_traceback(out_dir: Path, rank: int) -> None:
    """Append the traceback of what ended a run to <out_dir>/errors.log (the one-line CLI error points
    here; MEGALITE_DEBUG=1 also prints it). Appended only as a regular file of the folder (files.open_append:
    never through a symlink, a FIFO or a name shared by hard links); one that is not is left alone, silently:
    the error being reported matters more, and its one line is printed anyway."""
    try:
        if out_dir.is_dir():
            with open_append(out_dir / "errors.log") as f:
                f.write(f"--- rank {rank}, {time.strftime('%Y-%m-%dT%H:%M:%S')}\n{traceback.format_exc()}")
    except OSError:
        pass


def start_line(cfg: Config, layout, device_type: str, precision: str) -> str:
    par = cfg.parallel
    return (f"megalite: {layout} on {layout.world_size} {device_type} process(es), "
            f"{num_microbatches(cfg)} micro-batches/step, schedule {par.schedule}, "
            f"{_zero(par)}, precision {precision}{_features(cfg)}")


def _zero(par) -> str:
    """`zero1 on|off` as every start line said it before ZeRO-2 and 3; `zero 2` or `zero 3` at those levels."""
    return f"zero {par.zero}" if par.zero >= 2 else f"zero1 {'on' if par.zero_level else 'off'}"


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


def step_line(rec: dict, total: int, elapsed: float, done_steps: int, stop_at: int = 0, bpb: bool = False) -> str:
    """One logged step. `elapsed` covers `done_steps` steps after the first of this launch: the first step
    (start-up, lazy allocations, the first communicator set-up) is not representative, so no ETA is guessed
    from it. A launch that stops early (`stop_at`: train.stop_at_step, when still ahead of it) times its ETA to
    that step, and the stop step itself shows none: this launch ends there, and the rerun's time is not this
    launch's to guess. `bpb`: show the validation loss in bits per byte too (a BPE run: for bytes it is the
    loss / ln 2, and metrics.jsonl has it as `val_bpb` either way)."""
    end = stop_at if 0 < stop_at < total else total
    if rec["step"] == end < total:
        eta = "stops here (train.stop_at_step)"
    elif done_steps > 0:
        eta = f"ETA {fmt_time(elapsed / done_steps * (end - rec['step']))}" + (f" to step {end}" if end < total else "")
    else:
        eta = "ETA after step 2"
    val = f" | val {rec['val_loss']:.4f}" if "val_loss" in rec else ""
    val += f" ({rec['val_bpb']:.3f} bits/byte)" if bpb and "val_bpb" in rec else ""
    return (f"step {rec['step']:>5}/{total} | loss {rec['loss']:.4f}{val} | lr {rec['lr']:.2e} | "
            f"grad-norm {rec['grad_norm']:.3f} | {rec['tokens_per_s']:,.0f} tok/s | "
            f"{rec['ms_per_step']:.0f} ms/step | {eta}")


def fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def stop_line(cfg: Config, stopped_by: str, step: int, saved: int) -> str:
    """The line a stopped run ends with: what stopped it, where its checkpoint is and how to go on. After
    train.stop_at_step it also says that the rerun continues to train.steps."""
    line = f"megalite: stopped by {stopped_by} at step {step}/{cfg.train.steps}{resume_hint(cfg, saved)}"
    if stopped_by == "train.stop_at_step" and saved > 0 and cfg.checkpoint.dir:
        line += f" (it trains on to step {cfg.train.steps}, train.steps; train.stop_at_step={step} is then behind it)"
    return line


def resume_hint(cfg: Config, saved: int) -> str:
    """Where the stop left its checkpoint, and how to continue (rerunning the command resumes with the default
    checkpoint.resume=auto; a resume=PATH or =none run needs =auto instead)."""
    if not cfg.checkpoint.dir:
        return " (checkpoints are off: checkpoint.dir is empty; nothing was saved)"
    if saved <= 0:
        return f"; no checkpoint was saved in {cfg.checkpoint.dir}"
    again = ("run the same command again" if cfg.checkpoint.resume == "auto" else
             f"run the same command with --checkpoint.resume=auto instead of '{cfg.checkpoint.resume}'")
    return f"; checkpoint {Path(cfg.checkpoint.dir) / step_dir(saved)}; to resume, {again}"
