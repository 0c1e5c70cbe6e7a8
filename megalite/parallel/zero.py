"""ZeRO-2 and ZeRO-3 over dp x cp: each rank keeps chunk r of every gradient (2), and of every weight (3).

The cut is per tensor (`data.dp_pieces(per_tensor=True)`, FSDP's per-parameter cut): rank r of the n ranks of
the dp x cp group holds elements `shard_range(k, r, n)` of each local tensor's k valid elements (the tp slice's;
vocab padding rows are never sharded). The optimizer keeps the same chunk's moments and updates only it; the
checkpoint's write plan cuts a stage the same way at zero >= 2, so each rank writes what it holds.

A unit is what the caller hands over as one module (a transformer block), plus a root unit (every other
parameter of the stage: embeddings, final norm, head). Per unit and micro-batch, in order:

    forward    zero 3: all-gather the unit's weights before it runs (a forward pre-hook; the next block's
               gather is started asynchronously when this one's forward begins: `overlap`), and free them
               after its forward (a forward hook) when reshard_after_forward, unless a backward needs them
    backward   zero 3: all-gather them again before the unit's backward (a hook on its output's gradient;
               a fully recomputed block is gathered there, before the recomputation runs)
               once every parameter of the unit has accumulated this micro-batch's gradient (post-accumulate-
               grad hooks): reduce-scatter (sum) the unit's whole gradients, add this rank's chunk to its
               gradient shard and drop the whole gradient (p.grad = None); zero 3: free the weights
    finish()   after the step's last backward: any unit still pending reduces (in unit order on every rank),
               every shard is divided by n (the dp x cp mean); zero 3: the root unit is freed

The rule under pp (1F1B, interleaved): a stage gathers a block before each micro-batch's forward and again before
each micro-batch's backward (2 m all-gathers per step for m micro-batches on the rank), and frees it after each;
with reshard_after_forward = false a block gathered by its first forward stays until its m-th backward (one all-
gather per step, the whole stage's weights held while micro-batches are in flight). The root unit is gathered once
per step and freed by finish() (in evaluation, no_grad: after each forward). Gradients are reduce-scattered once
per micro-batch (m reduce-scatters per step): the whole gradient never outlives one block's backward.

Collectives (every rank of the dp x cp group runs the same model and schedule, so they meet in the same order):
    all-gather  over dp x cp: a unit's chunks, one equal-sized call per unit (each tensor padded to n chunks)
    reduce-scatter over dp x cp: a unit's gradients, rank-major (chunk r of every tensor, then r + 1, ...)
"""
from __future__ import annotations

import math
from contextlib import contextmanager
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


# torch >= 2.12 names them *_single (the *_tensor spellings warn); older torch has only those
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
from .grid import Axis
from .partition import partition_of, shard_range, tp_box


def eager(hook):
    """A hook dynamo never traces (train.compile compiles each block's call, hooks included): it runs between
    the compiled graphs, so they see the weights it gathered as their inputs, as torch's FSDP2 hooks are
    skipped by dynamo (`torch._dynamo.config.skip_fsdp_hooks`) when a fully_shard block is compiled."""
    return torch._dynamo.disable(hook, recursive=True)


class Unit:
    """Parameters gathered and reduced together: [(global name, parameter)] in name order."""

    def __init__(self, named: list):
        self.named = sorted(named, key=lambda np_: np_[0])
        self.accumulated = 0  # parameters that have accumulated this micro-batch's gradient
        self.backwards = 0  # backwards finished this step
        self.gathered = False
        self.in_backward = False
        self.pending = None  # an async all-gather started ahead (overlap): (work, flat)


class ShardedState:
    """ZeRO-2 (gradients) or ZeRO-3 (gradients and weights) shards of a stage's parameters, with their hooks.

    The GradBuffer interface (zero, arm, finish, grad) for finalize and the optimizer: `grad(name)` is this
    rank's chunk of the mean gradient, `weight(name)` (zero 3) its chunk of the weight."""

    def __init__(self, named_params: list, units: list, root: nn.Module, tp: Axis, dp: Axis, level: int,
                 reshard_after_forward: bool = True, overlap: bool = False, replicate: Axis = Axis(1, 0)):
        # dp: the ranks a tensor is cut over; replicate (hybrid sharding): the ranks holding the same chunk
        self.tp, self.dp, self.replicate, self.level = tp, dp, replicate, level
        self.chunks_over = dp  # the gradient norm adds the chunks' squares over it (finalize.grad_norm)
        self.reshard, self.overlap = reshard_after_forward, overlap
        self.named = list(named_params)
        self.valid = {n: tp_box(partition_of(p), tp.rank, tp.size).numel for n, p in self.named}
        self.range = {n: shard_range(k, dp.rank, dp.size) for n, k in self.valid.items()}
        self.chunk = {n: math.ceil(k / dp.size) for n, k in self.valid.items()}
        self.grads = {n: torch.zeros(b - a, dtype=torch.float32, device=p.device)
                      for (n, p), (a, b) in zip(self.named, (self.range[n] for n, _ in self.named))}
        by_param = {p: n for n, p in self.named}
        self.units = [Unit([(by_param[p], p) for p in m.parameters()]) for m in units]
        in_units = {p for m in units for p in m.parameters()}
        self.root = Unit([(n, p) for n, p in self.named if p not in in_units])
        self.units.append(self.root)
        self._unit_of = {p: u for u in self.units for _, p in u.named}
        self.weights: dict[str, torch.Tensor] = {}
        self.shapes = {n: tuple(p.shape) for n, p in self.named}
        self.expected = 1
        self.reduced = 0  # reduce-scatters run (a test counts them)
        self.sent = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}  # bytes handed to collectives
        for _, p in self.named:
            p.grad = None
            p.register_post_accumulate_grad_hook(self._accumulated)
        if level >= 3:
            with torch.no_grad():
                for n, p in self.named:
                    a, b = self.range[n]
                    self.weights[n] = p.detach().reshape(-1)[a:b].clone()
                    self._own_storage(n, p)
            for u in self.units:
                self._free(u)
            self._modules = list(units)
            for i, m in enumerate(units):
                m.register_forward_pre_hook(eager(lambda mod, args, i=i: self._before_forward(i)))
                m.register_forward_hook(eager(lambda mod, args, out, i=i: self._after_forward(i, out)))
            root.register_forward_pre_hook(eager(lambda mod, args: self.gather(self.root)))
            root.register_forward_hook(eager(lambda mod, args, out: self._after_root(out)))

    # ------------------------------------------------------------ the GradBuffer interface
    def zero(self) -> None:
        for g in self.grads.values():
            g.zero_()
        for u in self.units:
            u.accumulated = u.backwards = 0

    def arm(self, num_micro: int) -> None:
        self.expected = num_micro

    def grad(self, name: str, p=None) -> torch.Tensor:
        return self.grads[name]

    def weight(self, name: str) -> torch.Tensor:
        return self.weights[name]

    def finish(self) -> None:
        """After the step's last backward: reduce any unit still pending (a parameter with no gradient this
        micro-batch), then average every chunk over dp x cp; zero 3: free every unit (the root included)."""
        for u in self.units:
            if u.accumulated:
                self._reduce(u)
        for g in self.grads.values():
            g.div_(self.dp.size * self.replicate.size)
        if self.level >= 3:
            for u in self.units:
                if u.pending is not None:  # a prefetch no forward used (the weights change in the step)
                    u.pending[0].wait()
                    u.pending = None
                self._free(u)

    # ------------------------------------------------------------ gradients: reduce-scatter per unit
    def _accumulated(self, p) -> None:
        u = self._unit_of[p]
        u.accumulated += 1
        if u.accumulated == len(u.named):
            self._reduce(u)

    def _reduce(self, u: Unit) -> None:
        """Reduce-scatter (sum) the unit's whole gradients; add this rank's chunk to its shard; drop them."""
        n = self.dp.size
        rows = []
        for name, p in u.named:
            g = torch.zeros(n * self.chunk[name], dtype=torch.float32, device=p.device)
            if p.grad is not None:
                g[:self.valid[name]] = p.grad.reshape(-1)[:self.valid[name]]
            rows.append(g.view(n, self.chunk[name]))
        flat = torch.cat(rows, dim=1).reshape(-1)  # rank-major: chunk r of every tensor, then r + 1
        out = torch.empty(flat.numel() // n, dtype=flat.dtype, device=flat.device)
        _reduce_scatter(out, flat, group=self.dp.group)
        self.sent["reduce_scatter"] += flat.numel() * flat.element_size()
        if self.replicate.active:  # hybrid: the shard groups' sums added across them
            dist.all_reduce(out, group=self.replicate.group)
            self.sent["all_reduce"] += out.numel() * out.element_size()
        self.reduced += 1
        off = 0
        for name, p in u.named:
            a, b = self.range[name]
            self.grads[name] += out[off:off + b - a]
            off += self.chunk[name]
            p.grad = None
        u.accumulated = 0
        u.backwards += 1
        u.in_backward = False
        if self.level >= 3 and u is not self.root and (self.reshard or u.backwards == self.expected):
            self._free(u)

    # ------------------------------------------------------------ weights (zero 3): all-gather per unit
    def _start_gather(self, u: Unit):
        n = self.dp.size
        mine = torch.cat([F.pad(self.weights[name], (0, self.chunk[name] - self.weights[name].numel()))
                          for name, _ in u.named])
        flat = torch.empty(n * mine.numel(), dtype=mine.dtype, device=mine.device)
        self.sent["all_gather"] += flat.numel() * flat.element_size()
        return _all_gather(flat, mine, group=self.dp.group, async_op=True), flat

    def gather(self, u: Unit) -> None:
        """Make every parameter of the unit whole (its local tp slice): wait for a prefetched all-gather or
        run one, and put each tensor's n chunks back in place (padding rows: zeros)."""
        if u.gathered or not u.named:
            return
        work, flat = u.pending or self._start_gather(u)
        u.pending = None
        work.wait()
        n = self.dp.size
        rows = flat.view(n, -1)
        off = 0
        with torch.no_grad():
            for name, p in u.named:
                c, k = self.chunk[name], self.valid[name]
                p.untyped_storage().resize_(p.numel() * p.element_size())
                whole = p.data.view(-1)  # .data: the write leaves p's version counter (autograd's check) alone
                whole[:k] = rows[:, off:off + c].reshape(-1)[:k]
                whole[k:] = 0
                off += c
        u.gathered = True

    def _free(self, u: Unit) -> None:
        """Resize each weight's storage to nothing (FSDP2's free): the tensors autograd saved for backward that
        view a weight (a Linear saves weight.t()) share that storage, so they release it too, and see the
        weight again when the gather before backward refills the same storage in place. Replacing p.data
        instead would leave those views holding the whole weight from forward to backward."""
        for _, p in u.named:
            p.untyped_storage().resize_(0)
        u.gathered = False

    def _before_forward(self, i: int) -> None:
        u = self.units[i]
        self.gather(u)
        if self.overlap and i + 1 < len(self._modules) and torch.is_grad_enabled() and not u.in_backward:
            nxt = self.units[i + 1]
            if not nxt.gathered and nxt.pending is None:
                nxt.pending = self._start_gather(nxt)

    def _after_forward(self, i: int, out):
        u = self.units[i]
        if not torch.is_grad_enabled():  # evaluation: no backward comes
            self._free(u)
            return out
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g: (self._before_backward(u), g)[1])
        if self.reshard and not u.in_backward:
            self._free(u)
        return out

    def _after_root(self, out):
        if not torch.is_grad_enabled():  # evaluation: freed after each forward (training: by finish)
            self._free(self.root)
        return out

    def _before_backward(self, u: Unit) -> None:
        u.in_backward = True  # a recomputation's forward inside this backward must not free it
        self.gather(u)

    @contextmanager
    def whole(self):
        """zero 3: every weight gathered (a checkpoint reads or writes whole tensors), then scattered back
        into the chunks and freed."""
        if self.level < 3:
            yield
            return
        for u in self.units:
            self.gather(u)
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.named:
                    a, b = self.range[n]
                    self.weights[n].copy_(p.detach().reshape(-1)[a:b])
                    self._own_storage(n, p)  # a reader that viewed it through numpy left it unresizable
            for u in self.units:
                self._free(u)

    def _own_storage(self, name: str, p) -> None:
        """Give p a storage of its own that _free can resize (outside forward and backward: nothing views it)."""
        p.data = torch.zeros(self.shapes[name], dtype=p.dtype, device=p.device)

