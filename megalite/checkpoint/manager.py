"""The training loop's checkpoint policy: resume, save every `interval`, at the end, and on SIGTERM/SIGINT."""
from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from . import load_checkpoint, save_checkpoint
from .layout import LATEST, LOCK, CheckpointError, committed_steps, read_latest, step_dir
from .save import AsyncSaver, bcast_object, collect
from .state import seed_everything
from .verify import verify


class CheckpointManager:
    def __init__(self, cfg, grid, log=print):
        self.cfg, self.grid, self.c = cfg, grid, cfg.checkpoint
        self.root = Path(self.c.dir) if self.c.dir else None
        self.log = log if grid.rank == 0 else (lambda *a: None)
        self.saver = AsyncSaver() if self.c.async_ else None
        self.last_saved = -1
        self._signal = 0
        self._old_handlers = {}
        self._lock_fd = None

    # ------------------------------------------------------------ start-up
    def check_writable(self, out_dir: Path) -> None:
        """Fail before the first step, not after an hour of training: train.out_dir and checkpoint.dir
        must be writable and the checkpoint folder not in use by another run. The lock is an flock held by
        rank 0 for the run, so a killed run never leaves it stuck (the kernel releases it)."""
        err, created = None, []
        if self.grid.rank == 0:
            for field, folder in (("checkpoint.dir", self.root), ("train.out_dir", out_dir)):
                if folder is None or err:
                    continue
                missing = [p for p in [folder, *folder.parents] if not p.exists()]
                try:
                    folder.mkdir(parents=True, exist_ok=True)
                    created += missing[-1:]  # the topmost folder this check made
                    probe = folder / f".write-test-{os.getpid()}"
                    probe.write_text("ok")
                    probe.unlink()
                except OSError as e:
                    err = f"{field}: cannot write to '{folder}' ({e.strerror or e})"
            if not err and self.root is not None:
                err = self._take_lock()
            if err:  # a failed start leaves nothing behind
                for folder in created:
                    if not any(p.is_file() for p in folder.rglob("*")):
                        shutil.rmtree(folder, ignore_errors=True)
        err = bcast_object(err, self.grid, self.grid.cpu)
        if err:
            raise CheckpointError(err)

    def _take_lock(self):
        fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            return (f"checkpoint.dir '{self.root}' is in use by another run ({holder} holds {self.root / LOCK}); "
                    f"point this run at another checkpoint.dir")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        self._lock_fd = fd
        return None

    def release(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def _choose_auto(self):
        """resume=auto: the step `latest` names if it verifies, else the newest that does (said loudly)."""
        if self.root is None or not self.root.is_dir():
            return None, []
        named = read_latest(self.root)
        steps = [step_dir(s) for s in reversed(committed_steps(self.root))]
        candidates = ([named] if named else []) + [s for s in steps if s != named]
        if not candidates:
            return None, []
        warnings = []
        for name in candidates:
            _, problems = verify(self.root / name)
            if not problems:
                return str(self.root / name), warnings
            warnings.append(f"WARNING: resume=auto: skipping {self.root / name}: {problems[0]}"
                            + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
        tried = "; ".join(w.split("skipping ", 1)[1] for w in warnings)
        raise CheckpointError(f"resume=auto: no checkpoint under '{self.root}' verifies: {tried}")

    def resume(self, tr) -> None:
        """checkpoint.resume: '' = fresh; 'auto' = latest if any (falling back to the newest checkpoint that
        verifies, loudly); PATH = that checkpoint or an error, never a silent fresh start."""
        want = self.c.resume
        if not want:
            return
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
            path, warnings = choice
            for w in warnings:
                self.log(w)
            if path is None:
                self.log(f"resume=auto: no checkpoint under '{self.c.dir}' ({LATEST} not found); starting fresh")
                return
            if warnings:
                self.log(f"WARNING: resume=auto: falling back to {path}")
        else:
            path = Path(want)
        info = load_checkpoint(path, tr.model, tr.optimizer, self.grid, model_config=self.cfg.to_dict()["model"])
        tr.step, tr.tokens_seen = info.step, info.tokens_seen
        tr.sampler.load_state_dict(info.data)
        self.last_saved = info.step
        for w in info.warnings:
            self.log(w)
        how = "same layout" if info.same_layout else f"resharded from {info.manifest.layout} to {self.grid.layout}"
        if not info.rng_restored:
            seed_everything(self.cfg.train.seed + info.step, self.grid)
            how += "; RNG states re-seeded from (seed, step): no per-rank states for this layout"
        self.log(f"resumed from {info.path} at step {info.step} ({how})")

    def reserve(self, tr) -> None:
        """Async saves: allocate the host staging buffers before training starts."""
        if self.saver is not None and self.root is not None:
            self.saver.stager.reserve(collect(tr.params, tr.optimizer, self.grid, {}))

    # ------------------------------------------------------------ signals
    def install_signal_handlers(self) -> None:
        def handler(signum, frame):
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

    # ------------------------------------------------------------ saving
    def save(self, tr, wait: bool = False) -> None:
        if self.root is None or self.last_saved == tr.step:
            return
        if self.saver is not None:
            self._poll()
        try:
            path = save_checkpoint(self.root, tr.step, tr.model, tr.optimizer, self.grid,
                                   config=self.cfg.to_dict(), tokens_seen=tr.tokens_seen,
                                   data_state=tr.sampler.state_dict(), keep_last=self.c.keep_last, saver=self.saver)
        except CheckpointError as e:
            self._failed(e)
            return
        self.last_saved = tr.step
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
