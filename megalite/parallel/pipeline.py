"""Pipeline parallelism: layer partition, point-to-point activation passing, and the schedules.

Stages keep *global* layer ids (stage 1 of 2 over 4 layers holds blocks 2 and 3), so checkpoints name
layers the same way whatever the pipeline size. With vpp virtual stages per rank (interleaved 1F1B), the
layers are cut into pp * vpp groups and chunk j of rank r holds group j * pp + r (Megatron's assignment);
`place_of` is the one function that maps a parameter's placement to its (pp rank, chunk).

The schedules run one step's micro-batches through this rank's stage; `get_schedule` is the one place that
picks one from the config (Megatron's get_forward_backward_func), by name from `SCHEDULES`.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .grid import Layout, ParallelGrid


def partition_layers(n_layer: int, pp: int, prefix: str = "parallel.") -> list[range]:
    """Contiguous layer ranges, one per stage; when uneven, the earlier stages get one layer more.

    (The last stage also carries the LM head and the loss; the first carries only the cheap embedding
    lookups, so extra blocks go to the front.) Whether pp stages fit n_layer layers is Layout.validate's
    call (the one definition of a valid layout); `prefix` names the field in its one-line error.
    """
    Layout(1, pp, 1).validate({"n_layer": n_layer}, prefix=prefix)
    base, extra = divmod(n_layer, pp)
    out, start = [], 0
    for stage in range(pp):
        n = base + (1 if stage < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def chunk_layers(n_layer: int, pp: int, vpp: int = 1) -> list[list[range]]:
    """[pp rank][chunk] -> the layers of that model chunk: group j * pp + r of pp * vpp contiguous groups."""
    groups = partition_layers(n_layer, pp * vpp, prefix="parallel.vpp * parallel." if vpp != 1 else "parallel.")
    return [[groups[j * pp + r] for j in range(vpp)] for r in range(pp)]


def place_of(placement: str, n_layer: int, pp: int, vpp: int = 1) -> tuple[int, int]:
    """(pp rank, chunk) that owns a parameter with this placement (see Partition.placement): "first" is
    chunk 0 of rank 0 (the embeddings), "last" chunk vpp-1 of rank pp-1 (final LayerNorm, LM head)."""
    if placement == "first":
        return 0, 0
    if placement == "last":
        return pp - 1, vpp - 1
    layer = int(placement.split(".", 1)[1])
    for r, chunks in enumerate(chunk_layers(n_layer, pp, vpp)):
        for j, layers in enumerate(chunks):
            if layer in layers:
                return r, j
    raise ValueError(f"placement '{placement}' names no layer of a {n_layer}-layer model")


def stage_of(placement: str, n_layer: int, pp: int, vpp: int = 1) -> int:
    """The pipeline rank that owns a parameter with this placement."""
    return place_of(placement, n_layer, pp, vpp)[0]


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

    def send_to(self, t: torch.Tensor, dst: int, tag: int = 0) -> None:
        t = t.detach().to(self.dtype).contiguous()
        self.pending.append((dist.isend(t, dst, tag=tag), t))

    def recv_from(self, src: int, tag: int = 0) -> torch.Tensor:
        t = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        dist.recv(t, src, tag=tag)
        return t

    def send_forward(self, act):
        self.send_to(act, self.grid.next_rank)

    def recv_forward(self):
        return self.recv_from(self.grid.prev_rank)

    def send_backward(self, grad):
        self.send_to(grad, self.grid.prev_rank)

    def recv_backward(self):
        return self.recv_from(self.grid.next_rank)

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


# ---------------------------------------------------------------- interleaved (virtual stages)
def interleaved_order(pp: int, pp_rank: int, num_micro: int, vpp: int, all_warmup: bool = False) -> list:
    """The ("F" | "B", micro, chunk) operations rank pp_rank runs, in Megatron's interleaved 1F1B order.

    Forwards go in groups of pp micro-batches: chunk 0 of micro 0..pp-1, chunk 1 of the same, ...;
    backwards the same with chunks reversed. Warm-up: 2 * (pp - rank - 1) + (vpp - 1) * pp forwards (at most
    all of them), then one forward + one backward pairs, then cool-down: megatron-core's current rule (its
    schedule table; checked against megatron-core 0.16 in tests/test_foreign_megatron.py). Older Megatron
    ran every forward first whenever m == pp. With all_warmup (afab, forward-only) every forward runs before
    the first backward.
    """
    total, group = num_micro * vpp, pp * vpp

    def unit(k: int, backward: bool) -> tuple:
        g, within = divmod(k, group)
        chunk = within // pp
        return ("B" if backward else "F", g * pp + within % pp, vpp - 1 - chunk if backward else chunk)

    if all_warmup:
        warmup = total
    else:
        warmup = min(2 * (pp - pp_rank - 1) + (vpp - 1) * pp, total)
    # Phase 1, warm-up: forwards only.
    ops = [unit(k, False) for k in range(warmup)]
    # Phase 2, steady state: one forward, then one backward.
    for k in range(total - warmup):
        ops += [unit(warmup + k, False), unit(k, True)]
    # Phase 3, cool-down: the backwards still due.
    ops += [unit(k, True) for k in range(total - warmup, total)]
    return ops


class _VirtualRunner:
    """Forward/backward of one (micro-batch, chunk) on a rank holding vpp chunks.

    Virtual stage s = chunk * pp + rank; activations cross from s to s + 1 (the last rank's chunk j feeds
    rank 0's chunk j + 1), gradients go back. Every message is tagged with (micro, boundary, direction),
    so sends and receives pair up whatever order the two ranks post them in.
    """

    def __init__(self, stage_fn, inputs, p2p: Optional[P2P], grid: ParallelGrid, vpp: int):
        self.stage_fn, self.inputs, self.p2p, self.grid, self.vpp = stage_fn, inputs, p2p, grid, vpp
        self.pp, self.rank = grid.layout.pp, grid.coord.pp
        self.n_virtual = self.pp * vpp
        self.in_flight: list[list] = [[] for _ in range(vpp)]
        self.losses: list[torch.Tensor] = []

    def _neighbour(self, step: int) -> int:
        return self.grid.layout.rank_of(self.grid.coord._replace(pp=(self.rank + step) % self.pp))

    def _tag(self, micro: int, boundary: int, backward: bool) -> int:
        return 2 * (micro * self.n_virtual + boundary) + int(backward)

    def forward(self, micro: int, chunk: int, keep: bool = True) -> None:
        s = chunk * self.pp + self.rank
        if s == 0:
            x = self.inputs[micro]
        else:
            x = self.p2p.recv_from(self._neighbour(-1), self._tag(micro, s - 1, False))
            x.requires_grad_(keep)
        out = self.stage_fn(x, micro, chunk)
        if s == self.n_virtual - 1:
            self.losses.append(out.detach())
        else:
            self.p2p.send_to(out, self._neighbour(1), self._tag(micro, s, False))
        if keep:
            self.in_flight[chunk].append((x, out))

    def backward(self, micro: int, chunk: int) -> None:
        s = chunk * self.pp + self.rank
        x, out = self.in_flight[chunk].pop(0)
        if s == self.n_virtual - 1:
            torch.autograd.backward(out)
        else:
            torch.autograd.backward(out, self.p2p.recv_from(self._neighbour(1), self._tag(micro, s, True)))
        if s > 0:
            self.p2p.send_to(x.grad, self._neighbour(-1), self._tag(micro, s - 1, True))


def interleaved(stage_fn, inputs, num_micro: int, grid: ParallelGrid, p2p: Optional[P2P], vpp: int,
                all_warmup: bool = False) -> list:
    """Interleaved 1F1B over vpp model chunks per rank (afab order when all_warmup); stage_fn(x, micro, chunk).
    The bubble shrinks to (pp - 1) / (vpp * m + pp - 1) of the step, at vpp times the p2p messages."""
    r = _VirtualRunner(stage_fn, inputs, p2p, grid, vpp)
    for kind, micro, chunk in interleaved_order(grid.layout.pp, grid.coord.pp, num_micro, vpp, all_warmup):
        (r.forward if kind == "F" else r.backward)(micro, chunk)
    if p2p:
        p2p.wait()
    return r.losses


@torch.no_grad()
def interleaved_forward_only(stage_fn, inputs, num_micro: int, grid: ParallelGrid, p2p: Optional[P2P],
                             vpp: int) -> list:
    """Evaluation over virtual stages: every forward in the interleaved order, no backward."""
    r = _VirtualRunner(stage_fn, inputs, p2p, grid, vpp)
    for kind, micro, chunk in interleaved_order(grid.layout.pp, grid.coord.pp, num_micro, vpp, all_warmup=True):
        if kind == "F":
            r.forward(micro, chunk, keep=False)
    if p2p:
        p2p.wait()
    return r.losses


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


# ---------------------------------------------------------------- the one entry point
def interleaved_afab(stage_fn, inputs, num_micro: int, grid: ParallelGrid, p2p: Optional[P2P], vpp: int) -> list:
    """Virtual stages in all-forward-all-backward order: parallel.schedule = "afab" with vpp > 1."""
    return interleaved(stage_fn, inputs, num_micro, grid, p2p, vpp, all_warmup=True)


# Every schedule the config can choose, by name: (stage_fn, inputs, num_micro, grid, p2p[, vpp]) -> the last
# stage's loss per micro-batch. The interleaved ones take vpp and a stage_fn(x, micro, chunk).
SCHEDULES: dict[str, Callable[..., list]] = {
    "1f1b": one_f_one_b,
    "afab": afab,
    "interleaved-1f1b": interleaved,
    "interleaved-afab": interleaved_afab,
    "forward-only": forward_only,  # evaluation
    "interleaved-forward-only": interleaved_forward_only,
}


def schedule_name(schedule: str, vpp: int = 1, train: bool = True) -> str:
    """The SCHEDULES key for parallel.schedule ("1f1b" | "afab") and parallel.vpp, training or evaluating."""
    order = schedule if train else "forward-only"
    return f"interleaved-{order}" if vpp > 1 else order


def get_schedule(schedule: str, vpp: int = 1, train: bool = True) -> Callable[..., list]:
    """The function that runs one step (or one evaluation batch) through the pipeline for this config:
    run(stage_fn, inputs, num_micro, grid, p2p) -> the last stage's loss per micro-batch. Looked up in
    SCHEDULES when asked, so a benchmark may wrap an entry to time it."""
    fn = SCHEDULES[schedule_name(schedule, vpp, train)]
    return functools.partial(fn, vpp=vpp) if vpp > 1 else fn
