"""Pipeline parallelism: layer partition, point-to-point activation passing, and the two schedules.

Stages keep *global* layer ids (stage 1 of 2 over 4 layers holds blocks 2 and 3), so checkpoints name
layers the same way whatever the pipeline size.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .grid import ParallelGrid


def partition_layers(n_layer: int, pp: int) -> list[range]:
    """Contiguous layer ranges, one per stage; when uneven, the earlier stages get one layer more.

    (The last stage also carries the LM head and the loss; the first carries only the cheap embedding
    lookups, so extra blocks go to the front.)
    """
    if not 1 <= pp <= n_layer:
        raise ValueError(f"cannot split {n_layer} layers into {pp} pipeline stages")
    base, extra = divmod(n_layer, pp)
    out, start = [], 0
    for stage in range(pp):
        n = base + (1 if stage < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def stage_of(placement: str, n_layer: int, pp: int) -> int:
    """The pipeline stage that owns a parameter with this placement (see Partition.placement)."""
    if placement == "first":
        return 0
    if placement == "last":
        return pp - 1
    layer = int(placement.split(".", 1)[1])
    return next(s for s, r in enumerate(partition_layers(n_layer, pp)) if layer in r)


def num_warmup_microbatches(pp: int, pp_rank: int, num_micro: int) -> int:
    """1F1B warm-up: stage s runs (pp - s - 1) forwards before its first backward."""
    return min(pp - pp_rank - 1, num_micro)


class P2P:
    """Sends and receives between neighbouring stages.

    Sends are non-blocking (isend) and kept until `wait()` at the end of the step, so a stage never
    blocks on a send; receives block. Each direction between two ranks is a FIFO channel, and both
    schedules post receives in the order the neighbour sends, so no message can be mismatched.
    """

    def __init__(self, grid: ParallelGrid, shape: Sequence[int], dtype: torch.dtype, device: torch.device):
        self.grid, self.shape, self.dtype, self.device = grid, tuple(shape), dtype, device
        self.pending: list = []

    def _send(self, t: torch.Tensor, dst: int) -> None:
        t = t.detach().to(self.dtype).contiguous()
        self.pending.append((dist.isend(t, dst), t))

    def _recv(self, src: int) -> torch.Tensor:
        t = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        dist.recv(t, src)
        return t

    def send_forward(self, act):
        self._send(act, self.grid.next_rank)

    def recv_forward(self):
        return self._recv(self.grid.prev_rank)

    def send_backward(self, grad):
        self._send(grad, self.grid.prev_rank)

    def recv_backward(self):
        return self._recv(self.grid.next_rank)

    def wait(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


StageFn = Callable[[torch.Tensor, int], torch.Tensor]


class _Runner:
    """One step's forward and backward micro-steps; the schedules below only decide their order."""

    def __init__(self, stage_fn: StageFn, inputs: Sequence[torch.Tensor], p2p: Optional[P2P], grid: ParallelGrid):
        self.stage_fn, self.inputs, self.p2p, self.grid = stage_fn, inputs, p2p, grid
        self.in_flight: list = []  # (input, output) of micro-batches whose backward is still due
        self.losses: list[torch.Tensor] = []
        self.fwd_count = 0

    def forward(self) -> None:
        i = self.fwd_count
        self.fwd_count += 1
        if self.grid.is_first_stage:
            x = self.inputs[i]
        else:
            x = self.p2p.recv_forward().requires_grad_()
        out = self.stage_fn(x, i)
        if self.grid.is_last_stage:
            self.losses.append(out.detach())
        else:
            self.p2p.send_forward(out)
        self.in_flight.append((x, out))

    def backward(self) -> None:
        x, out = self.in_flight.pop(0)
        if self.grid.is_last_stage:
            torch.autograd.backward(out)
        else:
            torch.autograd.backward(out, self.p2p.recv_backward())
        if not self.grid.is_first_stage:
            self.p2p.send_backward(x.grad)


def afab(stage_fn: StageFn, inputs, num_micro: int, grid: ParallelGrid, p2p: Optional[P2P]) -> list:
    """All forwards, then all backwards: simple, the reference; holds every micro-batch's activations."""
    r = _Runner(stage_fn, inputs, p2p, grid)
    for _ in range(num_micro):
        r.forward()
    for _ in range(num_micro):
        r.backward()
    if p2p:
        p2p.wait()
    return r.losses


def one_f_one_b(stage_fn: StageFn, inputs, num_micro: int, grid: ParallelGrid, p2p: Optional[P2P]) -> list:
    """1F1B: at most (pp - stage) micro-batches in flight, so activation memory is bounded by pp, not m."""
    r = _Runner(stage_fn, inputs, p2p, grid)
    warmup = num_warmup_microbatches(grid.layout.pp, grid.coord.pp, num_micro)
    steady = num_micro - warmup
    # Phase 1, warm-up: fill the pipeline with forwards.
    for _ in range(warmup):
        r.forward()
    # Phase 2, steady state: one forward, then the backward of the oldest micro-batch in flight.
    for _ in range(steady):
        r.forward()
        r.backward()
    # Phase 3, cool-down: drain the backwards still due.
    for _ in range(warmup):
        r.backward()
    if p2p:
        p2p.wait()
    return r.losses


SCHEDULES = {"afab": afab, "1f1b": one_f_one_b}


@torch.no_grad()
def forward_only(stage_fn: StageFn, inputs, num_micro: int, grid: ParallelGrid, p2p: Optional[P2P]) -> list:
    """Evaluation: forwards through the pipeline, no backward; returns the last stage's losses."""
    losses = []
    for i in range(num_micro):
        x = inputs[i] if grid.is_first_stage else p2p.recv_forward()
        out = stage_fn(x, i)
        if grid.is_last_stage:
            losses.append(out)
        else:
            p2p.send_forward(out)
    if p2p:
        p2p.wait()
    return losses
