"""Asynchronous saves: the snapshot taken in the training loop, the writes and the commit in a thread.

The snapshot costs no copy where the optimizer can `hold` the tensors (megalite's ShardedAdamW, host
tensors: its next step writes out of place, double buffering); everything else is copied into host buffers
reused from one save to the next (Stager), as DCP's async_save does.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from .commit import commit_groups, save_collective
from .plan import Payload


class Stager:
    """Host copies of a payload in buffers reused from one save to the next (async saves).

    A tensor `keep` accepts is passed through uncopied: a host parameter or moment of an optimizer that
    `hold`s it (megalite's ShardedAdamW: its next step writes out of place, see AsyncSaver)."""

    def __init__(self):
        self.buffers: dict = {}

    def _buffer(self, fname: str, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get((fname, key))
        if buf is None or buf.shape != t.shape:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            buf.zero_()  # touch the pages now, not during the first save's stall
            self.buffers[(fname, key)] = buf
        return buf

    def reserve(self, pay: Payload, keep=lambda t: False) -> None:
        """Allocate every buffer up front (at start-up), so even the first async save only copies."""
        for fname, tensors in pay.files.items():
            for key, t in tensors.items():
                if not keep(t):
                    self._buffer(fname, key, t)

    def stage(self, pay: Payload, keep=lambda t: False) -> Payload:
        """The payload with every tensor `keep` refuses copied to its host buffer (the rest passed as is)."""
        out = Payload(files={}, records=pay.records, state=pay.state, step_files=pay.step_files)
        for fname, tensors in pay.files.items():
            out.files[fname] = {}
            for key, t in tensors.items():
                if keep(t):
                    out.files[fname][key] = t
                    continue
                buf = self._buffer(fname, key, t)
                buf.copy_(t, non_blocking=True)
                out.files[fname][key] = buf
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return out


class AsyncSaver:
    """At most one save in flight; everything but taking the snapshot (the checksums, the writes, the
    commit) runs in a thread, and a failure there is kept and raised by the next `poll()`/`wait()` in the
    training loop.

    The snapshot costs the caller no copy where the optimizer can `hold` the tensors (megalite's
    ShardedAdamW, host tensors): the thread writes the live parameters and moments themselves, and the
    optimizer's next step computes its update out of place into a spare set, so the bytes being written
    never change (double buffering; the step does the same arithmetic as in place).
    Anything else (device tensors, a torch.optim optimizer's state, parameters no optimizer holds) is
    copied first into host buffers reused from one save to the next, as DCP's async_save does.
    """

    def __init__(self, zero_copy: bool = True):
        self.stager = Stager()
        self.zero_copy = zero_copy  # False: copy every tensor (what `megalite bench ckpt` compares against)
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None
        self.last: Optional[Path] = None

    def held_keys(self, pay: Payload, optimizer) -> list:
        """The optimizer's keys of the payload tensors it can hold uncopied (whole host tensors it writes)."""
        if not self.zero_copy or not hasattr(optimizer, "hold"):
            return []
        return [k for ts in pay.files.values() for k in map(optimizer.holdable, ts.values()) if k is not None]

    def reserve(self, pay: Payload, optimizer=None) -> None:
        """At start-up: the optimizer's spare buffers, and host buffers for whatever it cannot hold."""
        keys = self.held_keys(pay, optimizer)
        if keys:
            optimizer.reserve_spare(keys)
        self.stager.reserve(pay, lambda t: bool(keys) and optimizer.holdable(t) is not None)

    def submit(self, root, step, pay, grid, meta, keep_last, keep=(), optimizer=None, direct: bool = False) -> None:
        self.wait()  # the previous save's tensors are free again (a held tensor's old buffer becomes its spare)
        every = commit_groups(grid).every  # made here, in the main thread, on every rank (new_group is collective)
        keys = self.held_keys(pay, optimizer)
        staged = self.stager.stage(pay, lambda t: bool(keys) and optimizer.holdable(t) is not None)
        if keys:
            optimizer.hold(keys, self.wait)

        def run():
            try:
                if grid.layout.world_size > 1:  # write once every rank has its snapshot: ranks sharing a
                    dist.barrier(group=every)  # host's cores never slow another's copy with their writes
                self.last = save_collective(root, step, staged, grid, meta, keep_last, keep, direct)
            except BaseException as e:  # noqa: BLE001
                self.error = e

        self.thread = threading.Thread(target=run, name=f"megalite-ckpt-{step}", daemon=True)
        self.thread.start()

    def poll(self) -> None:
        if self.thread is not None and not self.thread.is_alive():
            self.wait()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            e, self.error = self.error, None
            raise e
