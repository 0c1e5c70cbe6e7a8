"""The training loop's checkpoint policy: resume, save every `interval`, at the end, and on SIGTERM/SIGINT."""
from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint import AsyncSaver, load_checkpoint, save_checkpoint
from ..checkpoint.validate import read_origin
from ..checkpoint.verify import verify
from ..checkpoint.commit import recover
from ..base.fs import move_aside, unlink_quietly, write_new
from ..base.lock import RunLock, held
from ..parallel.agree import bcast_object
from ..checkpoint.plan import collect
from ..parallel.rng import seed_everything
from ..checkpoint.tree import LATEST, LOCK, committed_steps, parse_step_dir, read_latest, step_dir, tokenizer_rel
from ..base.errors import CheckpointError
from ..config import checkpoint_dir
from .schedule import lr_at
from ..checkpoint.validate import carried_by
from ..tokenizer import check_same


DEFAULT_SHUTDOWN_TIMEOUT_S = 120  # what launch/*.sh export as TORCH_ELASTIC_SHUTDOWN_TIMEOUT (unless set)
TORCHRUN_SHUTDOWN_TIMEOUT_S = 30  # torchrun's own default (torch/distributed/launcher/api.py)


def direct_io(cfg) -> bool:
    """checkpoint.direct_io: write checkpoint files around the page cache? "auto" says yes where training runs on
    GPUs (as process_group picks nccl), whose host threads wait on the device: a large save's page-cache copies
    and writeback then stall the loop's threads (`bench ckpt`'s waiting-loop rows at 512 MiB-1 GiB: 35-48% of
    a sync save through the page cache, 6-7% with O_DIRECT). A CPU-bound loop pays the bounce buffer's extra
    CPU instead, so "auto" is off on CPUs."""
    return {"on": True, "off": False}.get(cfg.checkpoint.direct_io, torch.cuda.is_available())


def signal_grace(cfg) -> tuple:
    """(seconds, where that number comes from) between a stop signal and the SIGKILL that follows it, or
    (None, why unknown). checkpoint.signal_grace_s when set; else, under torchrun (whose agent forwards
    SIGTERM/SIGINT to the workers and SIGKILLs them after its shutdown timeout), the agent's
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT, which the workers inherit (30 s when unset). A `torchrun --shutdown-timeout`
    flag is not visible to the workers: state it with checkpoint.signal_grace_s."""
    if cfg.checkpoint.signal_grace_s > 0:
        return float(cfg.checkpoint.signal_grace_s), "checkpoint.signal_grace_s"
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None, "not under torchrun and checkpoint.signal_grace_s not set"
    raw = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    if raw is None:
        return float(TORCHRUN_SHUTDOWN_TIMEOUT_S), "torchrun's default; TORCH_ELASTIC_SHUTDOWN_TIMEOUT is not set"
    try:
        return float(int(raw)), f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={raw}"
    except ValueError:
        return None, f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={raw!r} is not a number"


class CheckpointManager:
    def __init__(self, cfg, grid, log=print, force: bool = False):
        self.cfg, self.grid, self.c = cfg, grid, cfg.checkpoint
        self.root = Path(checkpoint_dir(cfg)) if self.c.dir else None
        self.force = force  # a fresh start may move an earlier run's checkpoints aside (never deletes them)
        self.resumed_path, self.resumed_event = None, None
        self.log = log if grid.rank == 0 else (lambda *a: None)
        self.saver = AsyncSaver() if self.c.async_ else None
        self.direct = direct_io(cfg)
        self.last_saved = -1
        self._signal = 0
        self._old_handlers = {}
        self.lock = RunLock(self.root / LOCK) if self.root is not None else None
        self._created: list = []  # what check_writable made (folders, the lock file): removed if start-up fails
        self.resumed_from = 0  # the step resumed from (0: fresh)
        self.keep: set = set()  # steps pruning must never delete (see _protect)
        # How long a stop signal leaves us (see signal_grace) against what a step + a save measured take.
        self.grace, self.grace_from = signal_grace(cfg)
        self.step_s, self.save_s, self._save_t0, self._grace_warned = 0.0, None, None, False

    # ------------------------------------------------------------ start-up
    def check_writable(self, out_dir: Path) -> None:
        """Fail before the first step, not after an hour of training: train.out_dir and checkpoint.dir
        must be writable and the checkpoint folder not in use by another run. The lock is an flock held by
        rank 0 for the run, so a killed run never leaves it stuck (the kernel releases it)."""
        err, created = None, self._created
        if self.grid.rank == 0:
            err = self._fresh_start_guard()
            for field, folder in (("checkpoint.dir", self.root), ("train.out_dir", out_dir)):
                if folder is None or err:
                    continue
                missing = [p for p in [folder, *folder.parents] if not p.exists()]
                try:
                    folder.mkdir(parents=True, exist_ok=True)
                    created += missing[-1:]  # the topmost folder this check made
                    probe = folder / f".write-test-{os.getpid()}"
                    write_new(probe, b"ok")  # never through a symlink planted at that name
                    probe.unlink()
                except OSError as e:
                    err = f"{field}: cannot write to '{folder}' ({e.strerror or e})"
            if not err and self.lock is not None:
                err = self.lock.take()
            if not err and self.root is not None:
                try:
                    for line in recover(self.root):  # at every start, under the lock
                        self.log(f"checkpoint: {line} (left by a killed save)")
                except OSError as e:
                    err = f"checkpoint.dir: cannot tidy '{self.root}' ({e.strerror or e})"
            if err:  # a failed start leaves nothing behind
                self.abandon()
        err = bcast_object(err, self.grid, self.grid.cpu)
        if err:
            raise CheckpointError(err, shared=True)  # rank 0 found it, every rank raises it: printed once

    def abandon(self) -> None:
        """Start-up failed (a bad resume, say): release the lock and remove what check_writable made, so a
        failed start leaves nothing behind. Folders that hold any file are kept."""
        self.release()
        if self.lock is not None and self.lock.created:
            unlink_quietly(self.lock.path)
        for folder in reversed(self._created):
            if folder.is_dir() and not folder.is_symlink() and not any(p.is_file() for p in folder.rglob("*")):
                shutil.rmtree(folder, ignore_errors=True)
        self._created.clear()

    def _fresh_start_guard(self):
        """resume=none into a folder that holds another run's checkpoints: refused (one line) unless --force,
        which moves that folder aside to `<dir>.old-<time>`; nothing is ever deleted."""
        if self.c.resume not in ("none", "") or self.root is None or not self.root.is_dir():
            return None
        steps = committed_steps(self.root)
        if not steps and read_latest(self.root) is None:
            return None
        what = f"'{self.root}' already holds checkpoints (newest {step_dir(steps[-1]) if steps else LATEST})"
        if not self.force:
            return (f"checkpoint.dir {what}; continue that run with --checkpoint.resume=auto (the default), "
                    f"start fresh in a new --checkpoint.dir, or pass --force to move the old one aside")
        if held(self.lock.path):
            return f"checkpoint.dir '{self.root}' is in use by a live run ({self.lock.path} is locked); not moving it"
        aside = move_aside(self.root)
        self.log(f"megalite: --force: moved the previous checkpoints {self.root} aside to {aside}")
        return None

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()

    def _choose_auto(self):
        """resume=auto: the step `latest` names if it verifies, else the newest that does (said loudly).
        Returns (path or None, warnings, the steps that failed verification)."""
        if self.root is None or not self.root.is_dir():
            return None, [], []
        warnings, failed = [], []
        try:
            named = read_latest(self.root)
        except CheckpointError as e:  # a `latest` that is not ours to follow: say so, fall back
            named = None
            warnings.append(f"WARNING: resume=auto: ignoring {e}")
        steps = [step_dir(s) for s in reversed(committed_steps(self.root))]
        candidates = ([named] if named else []) + [s for s in steps if s != named]
        if not candidates:
            if warnings:
                raise CheckpointError(f"resume=auto: {warnings[0].split('ignoring ', 1)[1]}; no other checkpoint "
                                      f"under '{self.root}'")
            return None, [], []
        for name in candidates:
            if (self.root / name).is_symlink():  # as `verify ROOT` refuses it: never load from elsewhere
                warnings.append(f"WARNING: resume=auto: skipping {self.root / name}: a symbolic link (to "
                                f"'{os.readlink(self.root / name)}'); a step folder of this root must be a real folder")
                continue
            _, problems = verify(self.root / name)
            if not problems:
                return str(self.root / name), warnings, failed
            if parse_step_dir(name) is not None:
                failed.append(parse_step_dir(name))
            warnings.append(f"WARNING: resume=auto: skipping {self.root / name}: {problems[0]}"
                            + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
        tried = "; ".join(w.split("skipping ", 1)[1] for w in warnings if "skipping " in w)
        raise CheckpointError(f"resume=auto: no checkpoint under '{self.root}' verifies: {tried}")

    def _protect(self, failed: list) -> None:
        """What pruning must never delete (rank 0 decides, at start-up): the steps that failed verification
        (kept as evidence; README says how to remove them) and the committed steps newer than the one this
        run resumed from (another history's, e.g. abandoned by a rollback)."""
        if self.root is None or self.grid.rank != 0:
            return
        self.keep = set(failed) | {s for s in committed_steps(self.root) if s > self.resumed_from}

    def resume(self, tr) -> None:
        """checkpoint.resume: 'none' = fresh; 'auto' (the default) = latest if any (falling back to the newest checkpoint that
        verifies, loudly); PATH = that checkpoint or an error, never a silent fresh start."""
        want = self.c.resume
        if want in ("none", "") or (want == "auto" and self.root is None):
            self._protect([])
            return  # a fresh start, or checkpoints turned off: nothing to look for
        if want == "auto":
            choice = None
            if self.grid.rank == 0:
                try:
                    choice = self._choose_auto()
                except CheckpointError as e:
                    choice = e
            choice = bcast_object(choice, self.grid, self.grid.cpu)
            if isinstance(choice, CheckpointError):
                raise choice
            path, warnings, failed = choice
            for w in warnings:
                self.log(w)
            if failed:
                self.log(f"WARNING: resume=auto: keeping the checkpoint(s) that failed verification "
                         f"({', '.join(step_dir(s) for s in failed)}); keep_last never deletes them. Inspect them "
                         f"with `megalite verify`, then remove them by hand")
            if path is None:
                self.log(f"resume=auto: no checkpoint under '{self.c.dir}' ({LATEST} not found); starting fresh")
                self._protect(failed)
                return
            if warnings:
                self.log(f"WARNING: resume=auto: falling back to {path}")
        else:
            path = Path(want)
        with tr.grads.whole():  # zero 3: the weights gathered, loaded, cut again
            info = load_checkpoint(path, tr.model, tr.optimizer, self.grid, model_config=self.cfg.to_dict()["model"])
        self._check_tokenizer(info, tr)
        tr.origin = read_origin(info.path, info.manifest)  # carried on into this run's checkpoints
        tr.step, tr.tokens_seen = info.step, info.tokens_seen
        tr.sampler.load_state_dict(info.data)
        self.last_saved = self.resumed_from = info.step
        self._protect(failed if want == "auto" else [])
        for w in info.warnings:
            self.log(w)
        how = "same layout" if info.same_layout else f"resharded from {info.manifest.layout} to {self.grid.layout}"
        if not info.rng_restored:
            seed_everything(self.cfg.train.seed + info.step, self.grid)
            how += "; RNG states re-seeded from (seed, step): no per-rank states for this layout"
        self.log(f"resumed from {info.path} at step {info.step} ({how})")
        self.resumed_path = str(info.path)
        self.resumed_event = {"layout": str(self.grid.layout), "from": str(info.path)}
        self._schedule_note((info.manifest.config or {}).get("train") or {}, info.step)

    def _check_tokenizer(self, info, tr) -> None:
        check_same(carried_by(info.path), tr.tokenizer, info.path / tokenizer_rel(info.manifest.layout.cp),
                   self.cfg.data.path)

    def _schedule_note(self, saved: dict, step: int) -> None:
        """The LR schedule is a function of (step, train.steps, warmup, lr, min_lr): changing train.steps on
        resume re-shapes it from here on. That is deliberate (the new total is the run's length); say so. Not at
        step 0 (a weights-only checkpoint from `split`: no run's schedule ever gave an LR)."""
        t = self.cfg.train
        if step == 0 or not isinstance(saved.get("steps"), int) or saved["steps"] == t.steps or step >= t.steps:
            return
        import dataclasses
        try:
            before = lr_at(step, dataclasses.replace(t, **{k: saved[k] for k in ("steps", "warmup_steps", "lr",
                                                                                  "min_lr") if k in saved}))
        except TypeError:
            return
        self.log(f"megalite: train.steps {saved['steps']} -> {t.steps}: the cosine LR schedule now spans "
                 f"{t.steps} steps, so the LR at step {step + 1} is {lr_at(step, t):.3g} "
                 f"(the saved run's schedule gave {before:.3g})")

    def reserve(self, tr) -> None:
        """Async saves: allocate the optimizer's spare set (or host staging buffers) before training starts."""
        if self.saver is not None and self.root is not None:
            self.saver.reserve(collect(tr.params, tr.optimizer, self.grid), tr.optimizer)

    # ------------------------------------------------------------ signals
    def install_signal_handlers(self) -> None:
        def handler(signum, frame):
            if not self._signal and self.grid.rank == 0 and self._too_slow():
                # said at once (a raw write: safe inside a handler), since the SIGKILL may come before the save
                os.write(2, (f"megalite: got {signal.Signals(signum).name}: the checkpoint after this step "
                             f"needs ~{self._need():.0f} s, longer than the {self.grace:g} s before SIGKILL "
                             f"({self.grace_from}); the work since the last checkpoint will likely be lost\n").encode())
            self._signal = signum

        for s in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old_handlers[s] = signal.signal(s, handler)
            except ValueError:  # not the main thread (tests driving train() from a thread)
                pass

    def restore_signal_handlers(self) -> None:
        for s, h in self._old_handlers.items():
            signal.signal(s, h)
        self._old_handlers.clear()

    def stop_requested(self) -> int:
        """All ranks agree at a step boundary: the signal any rank got (torchrun forwards it to all)."""
        flag = torch.tensor([self._signal], dtype=torch.int64)
        if self.grid.layout.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.grid.cpu)
        return int(flag.item())

    def _need(self) -> float:
        """Seconds from a signal to a committed save, at worst: the rest of a step, then a save."""
        return self.step_s + (self.save_s or 0.0)

    def _too_slow(self) -> bool:
        return self.grace is not None and self.root is not None and self.step_s > 0 and self._need() > self.grace

    def note_step(self, seconds: float, first: bool) -> None:
        """One loop iteration took `seconds` (the first of a launch is not representative: start-up). Once a
        step (+ a save, once one was measured) is longer than the grace a stop signal leaves, say so once
        (rank 0), naming the setting to raise."""
        if not first:
            self.step_s = max(self.step_s, seconds)
        if self._grace_warned or not self._too_slow():
            return
        self._grace_warned = True
        if self.grace_from == "checkpoint.signal_grace_s":
            fix = ("raise the launcher's grace (torchrun --shutdown-timeout or TORCH_ELASTIC_SHUTDOWN_TIMEOUT; "
                   "SLURM: KillWait, or sbatch --signal) and --checkpoint.signal_grace_s with it")
        else:
            fix = (f"raise TORCH_ELASTIC_SHUTDOWN_TIMEOUT before torchrun (launch/*.sh set "
                   f"{DEFAULT_SHUTDOWN_TIMEOUT_S}; with torchrun --shutdown-timeout S pass --checkpoint.signal_grace_s=S)")
        save = f" + a checkpoint {self.save_s:.1f} s" if self.save_s is not None else ""
        self.log(f"WARNING: a step takes up to {self.step_s:.1f} s{save}, more than the {self.grace:g} s a stop "
                 f"signal leaves before SIGKILL ({self.grace_from}): Ctrl-C or a preemption mid-step would lose "
                 f"the work since the last checkpoint; {fix}")

    # ------------------------------------------------------------ saving
    def save(self, tr, wait: bool = False) -> None:
        if self.root is None or self.last_saved == tr.step:
            return
        if self.saver is not None:
            self._poll()
        t0 = time.perf_counter()
        try:
            path = save_checkpoint(self.root, tr.step, tr.model, tr.optimizer, self.grid,
                                   config=self.cfg.to_dict(), tokens_seen=tr.tokens_seen,
                                   data_state=tr.sampler.state_dict(), keep_last=self.c.keep_last, saver=self.saver,
                                   keep=self.keep, tokenizer=tr.tokenizer.json.encode() if tr.tokenizer else None,
                                   origin=tr.origin.to_json().encode() if tr.origin else None,
                                   direct=self.direct)
        except CheckpointError as e:
            self._failed(e)
            return
        self.last_saved = tr.step
        if self.saver is None:
            self.save_s = time.perf_counter() - t0
        else:  # in flight: timed when a poll or wait sees it done (an upper bound, to within a step)
            self._save_t0 = t0
        if path is not None:
            self.log(f"checkpoint: saved {path}")
        if wait:
            self.wait()

    def _failed(self, e: CheckpointError) -> None:
        """checkpoint.on_error: 'stop' raises (the default); 'continue' warns and trains on."""
        if self.c.on_error != "continue":
            raise e
        self.log(f"WARNING: {e}; training continues (checkpoint.on_error=continue)")

    def _poll(self, wait: bool = False) -> None:
        try:
            self.saver.wait() if wait else self.saver.poll()
        except CheckpointError as e:
            self._failed(e)
        if self._save_t0 is not None and self.saver.thread is None:
            self.save_s, self._save_t0 = time.perf_counter() - self._save_t0, None

    def after_step(self, tr) -> None:
        if self.saver is not None:
            self._poll()  # a background failure surfaces here, in the training loop
        if self.root is not None and self.c.interval and tr.step % self.c.interval == 0:
            self.save(tr)

    def wait(self) -> None:
        if self.saver is not None:
            before = self.saver.thread is not None
            self._poll(wait=True)
            if before and self.saver.last is not None:
                self.log(f"checkpoint: saved {self.saver.last} (async)")

    def finish(self, tr) -> None:
        self.save(tr)
        self.wait()


__all__ = ["CheckpointManager"]
