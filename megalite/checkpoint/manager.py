"""The training loop's checkpoint policy: resume, save every `interval`, at the end, and on SIGTERM/SIGINT."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from . import load_checkpoint, save_checkpoint
from .layout import LATEST, CheckpointError, read_latest, step_dir
from .save import AsyncSaver, bcast_object


class CheckpointManager:
    def __init__(self, cfg, grid, log=print):
        self.cfg, self.grid, self.c = cfg, grid, cfg.checkpoint
        self.root = Path(self.c.dir) if self.c.dir else None
        self.log = log if grid.rank == 0 else (lambda *a: None)
        self.saver = AsyncSaver() if self.c.async_ else None
        self.last_saved = -1
        self._signal = 0
        self._old_handlers = {}

    # ------------------------------------------------------------ start-up
    def check_writable(self) -> None:
        """Fail before the first step, not after an hour of training, if the folder cannot be written."""
        if self.root is None:
            return
        err = None
        if self.grid.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                probe = self.root / f".write-test-{os.getpid()}"
                probe.write_text("ok")
                probe.unlink()
            except OSError as e:
                err = f"checkpoint.dir: cannot write to '{self.root}' ({e.strerror or e})"
        err = bcast_object(err, self.grid, self.grid.cpu)
        if err:
            raise CheckpointError(err)

    def resume(self, tr) -> None:
        """checkpoint.resume: '' = fresh; 'auto' = latest if any (saying which); PATH = that or an error."""
        want = self.c.resume
        if not want:
            return
        if want == "auto":
            if self.root is None or read_latest(self.root) is None:
                self.log(f"resume=auto: no checkpoint under '{self.c.dir}' ({LATEST} not found); starting fresh")
                return
            path = self.root
        else:
            path = Path(want)
        info = load_checkpoint(path, tr.model, tr.optimizer, self.grid, model_config=self.cfg.to_dict()["model"])
        tr.step, tr.tokens_seen = info.step, info.tokens_seen
        tr.sampler.load_state_dict(info.data)
        self.last_saved = info.step
        lay = info.manifest["layout"]
        how = "same layout" if info.same_layout else (
            f"resharded from tp={lay['tp']} pp={lay['pp']} dp={lay['dp']} to {self.grid.layout}; "
            f"RNG states re-seeded from (seed, step) since coordinates changed")
        if not info.rng_restored:
            from ..train import seed_everything
            seed_everything(self.cfg.train.seed + info.step, self.grid)
        self.log(f"resumed from {info.path} at step {info.step} ({how})")

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
            self.saver.poll()
        path = save_checkpoint(self.root, tr.step, tr.model, tr.optimizer, self.grid, config=self.cfg.to_dict(),
                               tokens_seen=tr.tokens_seen, data_state=tr.sampler.state_dict(),
                               keep_last=self.c.keep_last, saver=self.saver)
        self.last_saved = tr.step
        if path is not None:
            self.log(f"checkpoint: saved {path}")
        if wait:
            self.wait()

    def after_step(self, tr) -> None:
        if self.saver is not None:
            self.saver.poll()  # a background failure surfaces here, in the training loop
        if self.root is not None and self.c.interval and tr.step % self.c.interval == 0:
            self.save(tr)

    def wait(self) -> None:
        if self.saver is not None:
            before = self.saver.thread is not None
            self.saver.wait()
            if before and self.saver.last is not None:
                self.log(f"checkpoint: saved {self.saver.last} (async)")

    def finish(self, tr) -> None:
        self.save(tr)
        self.wait()


__all__ = ["CheckpointManager", "step_dir"]
