"""Data parallelism: bucketed gradient all-reduce over dp, and AdamW with optional ZeRO-1 state sharding.

Gradients live in a few flat buckets (each parameter's .grad is a view into one), so the dp all-reduce
is one collective per bucket, not one per parameter. With zero1 the cut is Megatron's distributed
optimizer's: the stage's local tensors (this tp rank's slices, sorted by global name) are viewed as one
concatenated flat space, cut into dp equal contiguous ranges (`dp_pieces`); dp rank r keeps the AdamW
moments of range r (a piece of the few tensors it overlaps, empty for the rest), updates only those
elements, and the updated ranges are all-gathered back. The checkpoint's write plan asks the same
function, so a rank writes its moments exactly as it holds them and every rank writes ~1/dp of its stage.

With overlap_grad_reduce each bucket's all-reduce starts, asynchronously, inside backward as soon as every
parameter in it has accumulated its last micro-batch's gradient (post-accumulate-grad hooks count them);
`finish()` waits for them before the optimizer step. ZeRO-1 keeps the all-reduce: its grad-norm clipping
needs every gradient, and the gradient buckets follow backward's order, not the name order of the flat
space its ranges are cut in, so a reduce-scatter of a bucket would not hand each rank its range.
"""
from __future__ import annotations

import bisect
import contextlib
import itertools
import math
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist

from .grid import Axis
from .partition import partition_of, shard_range, tp_box


SPACE_OWN, SPACE_TIED, SPACE_BUFFER = 0, 1, 2  # (False and True are SPACE_OWN and SPACE_TIED)


def flat_spaces(tensors: Iterable[tuple[str, int, int]], per_tensor: bool = False) -> list[list[tuple[str, int]]]:
    """The flat spaces a pipeline stage's tp slice is cut in over dp: [(name, numel)] in order.

    `tensors` are (global name, valid elements of this tp rank's slice, space): SPACE_OWN (or False) for the
    stage's own parameters, SPACE_TIED (or True) for a tied copy, SPACE_BUFFER for a module's buffer. The
    stage's own tensors, sorted by global name, form one concatenated space; a tied copy (the last stage's
    LM head tied to wte) is never written and is cut on its own, so the written tensors' cut is the same
    whether or not a stage holds a copy (an offline `split` sees no copies); buffers (a checkpoint writes
    them, no optimizer holds them) form one space of their own, after the parameters'.

    `per_tensor` (ZeRO-2 and 3): every tensor is a space of its own, in name order, so each dp rank holds
    chunk r of every tensor (FSDP's per-parameter cut): a block's gradients reduce-scatter, and its
    parameters all-gather, in one equal-sized collective, whichever ranks' ranges the block would fall in."""
    tensors = list(tensors)
    if per_tensor:
        return [[(n, k)] for n, k, _ in sorted(tensors)]
    own = sorted((n, k) for n, k, space in tensors if space == SPACE_OWN)
    buffers = sorted((n, k) for n, k, space in tensors if space == SPACE_BUFFER)
    return [own] + ([buffers] if buffers else []) + [[(n, k)] for n, k, space in sorted(tensors)
                                                      if space == SPACE_TIED]


def dp_pieces(tensors: Iterable[tuple[str, int, int]], dp_rank: int, dp_size: int,
              per_tensor: bool = False) -> dict[str, tuple[int, int]]:
    """{name: [start, end) of the tensor's flattened valid elements that dp rank `dp_rank` owns}.

    Each flat space (`flat_spaces`) is cut into dp ceil-sized contiguous ranges; rank r owns range r, so it
    holds a piece of the few tensors that range overlaps ((0, 0) for the others: nothing). The ZeRO-1
    optimizer (which moments a rank keeps) and the checkpoint write plan (which bytes a rank writes) both
    ask this one function: slices then grow by about dp per stage and tp rank, not dp per tensor."""
    out = {}
    for space in flat_spaces(tensors, per_tensor):
        lo, hi = shard_range(sum(k for _, k in space), dp_rank, dp_size)
        off = 0
        for name, k in space:
            a, b = min(max(lo - off, 0), k), min(max(hi - off, 0), k)
            out[name] = (a, b) if a < b else (0, 0)
            off += k
    return out


def _buckets(params: list, bucket_bytes: float) -> list[list]:
    """Group parameters in order into buckets of about bucket_bytes each."""
    out, cur, size = [], [], 0
    for p in params:
        cur.append(p)
        size += p.numel() * 4
        if size >= bucket_bytes:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def _backward_order(p) -> tuple:
    """Sort key: the order backward finishes gradients in (head first, then layers downwards, embeddings
    last), read from the placement tag."""
    place = partition_of(p).placement
    if place == "last":
        return (0, 0)
    if place.startswith("layer."):
        return (1, -int(place.split(".", 1)[1]))
    return (2, 0)


class GradBuffer:
    """Flat fp32 gradient buckets; parameter .grad tensors are views into them.

    Autograd accumulates micro-batch gradients into the views in place; `finish()` then averages each
    whole bucket over dp with one collective (started during backward with overlap).
    """
    chunks_over = None  # every rank holds whole gradients (parallel.zero.ShardedState: chunks, over an axis)

    def __init__(self, params: list, dp: Axis, bucket_mb: float = 25.0, overlap: bool = False):
        self.dp = dp
        self.buffers, self.buckets = [], []
        # Backward produces gradients from the last layer to the first: bucket in that order.
        for bucket in _buckets(sorted(params, key=_backward_order), bucket_mb * 2**20):
            flat = torch.zeros(sum(p.numel() for p in bucket), dtype=torch.float32, device=bucket[0].device)
            offset = 0
            for p in bucket:
                p.grad = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            self.buffers.append(flat)
            self.buckets.append(bucket)
        self.overlap = overlap and dp.active
        self.sent = {"all_reduce": 0}  # bytes handed to collectives (bench.memory's count is tested against it)
        self.works: list = [None] * len(self.buffers)
        self.expected = 0  # accumulations per parameter in this step (its micro-batches); 0: not armed
        if self.overlap:
            self._where = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
            self._hooks = [p.register_post_accumulate_grad_hook(self._accumulated) for p in self._where]

    def zero(self) -> None:
        for b in self.buffers:
            b.zero_()

    def grad(self, name: str, p) -> torch.Tensor:
        """The gradient finalize and the optimizer read: the whole one (zero 2 and 3 hand out a chunk)."""
        return p.grad

    def whole(self):
        """The parameters are whole already (zero 3 gathers them for a checkpoint: parallel.zero)."""
        return contextlib.nullcontext()

    def arm(self, num_micro: int) -> None:
        """Overlap: this step runs num_micro backwards per parameter; a bucket is reduced after the last."""
        if self.overlap:
            self.expected = num_micro
            self._seen = dict.fromkeys(self._where, 0)
            self._left = [len(b) for b in self.buckets]

    def _accumulated(self, p) -> None:
        if not self.expected:
            return
        self._seen[p] += 1
        if self._seen[p] == self.expected:
            i = self._where[p]
            self._left[i] -= 1
            if self._left[i] == 0:  # the bucket is final: reduce it while backward goes on
                self.works[i] = dist.all_reduce(self.buffers[i], group=self.dp.group, async_op=True)

    def finish(self) -> None:
        """Average every bucket over dp: wait for the overlapped all-reduces (start any whose parameters got
        fewer gradients than expected, in bucket order on every rank), or do them all now without overlap."""
        if not self.overlap:
            return self.all_reduce_mean()
        self.sent["all_reduce"] += sum(b.numel() * b.element_size() for b in self.buffers)
        for i, b in enumerate(self.buffers):
            if self.works[i] is None:
                self.works[i] = dist.all_reduce(b, group=self.dp.group, async_op=True)
        for i, b in enumerate(self.buffers):
            self.works[i].wait()
            b.div_(self.dp.size)
        self.works = [None] * len(self.buffers)
        self.expected = 0

    def all_reduce_mean(self) -> None:
        if not self.dp.active:
            return
        self.sent["all_reduce"] += sum(b.numel() * b.element_size() for b in self.buffers)
        works = [dist.all_reduce(b, group=self.dp.group, async_op=True) for b in self.buffers]
        for w, b in zip(works, self.buffers):
            w.wait()
            b.div_(self.dp.size)


def use_fused(setting: str, device: torch.device) -> bool:
    """train.fused_adamw: "auto" (the default) and "on" use torch's fused AdamW kernel wherever torch has one for
    the device type (CUDA; the CPU from torch 2.4), "off" never (the elementwise ops of `ShardedAdamW.step`)."""
    if setting == "off":
        return False
    from torch.optim.optimizer import _get_fused_kernels_supported_devices
    return hasattr(torch, "_fused_adamw_") and device.type in _get_fused_kernels_supported_devices()


# torch's CPU fused AdamW computes a tensor in SIMD vectors and its last numel % (vector width) elements one by one,
# and the two loops round differently (measured: ~8% of the elements held in tails differ after 8 steps): an
# element's last bit would depend on where the piece holding it ends (a ZeRO shard, a tp slice). 64 elements is a
# multiple of every vector width and task unit the kernel uses (16 fp32 / 32 bf16 lanes at most), so a run of 64
# goes wholly through the vector loop.
VECTOR_RUN = 64


def fused_adamw(groups: list, step: torch.Tensor, lr: float, betas: tuple, eps: float, weight_decay: float,
                grad_scale=None) -> None:
    """torch's fused AdamW kernel (`torch._fused_adamw_`) on `groups` = [weights, grads, exp_avgs, exp_avg_sqs],
    four lists of matching 1-d pieces, in place; `grad_scale` (a tensor or None) divides the gradients (written
    back). On the CPU every element goes through the kernel's vector loop, whichever piece holds it: each piece's
    head of whole VECTOR_RUNs in place, the tails packed end to end into zero-padded buffers of whole runs (a
    zero weight, gradient and moments stay zero through a step: eps keeps the denominator positive) and copied
    back. So an element's update has the same bits at every layout and ZeRO level, as the elementwise ops do.
    CUDA's kernel computes every element by the same code: its pieces go in as they are."""
    def kernel(lists: list) -> None:
        torch._fused_adamw_(*lists, [], [step] * len(lists[0]), lr=lr, beta1=betas[0], beta2=betas[1],
                            weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False, grad_scale=grad_scale)

    if groups[0][0].device.type != "cpu":
        kernel(groups)
        return
    heads, tails = [[] for _ in groups], [[] for _ in groups]
    for pieces in zip(*groups):
        n = pieces[0].numel()
        cut = n - n % VECTOR_RUN
        for role, t in enumerate(pieces):
            if cut:
                heads[role].append(t[:cut])
            if cut < n:
                tails[role].append(t[cut:])
    if heads[0]:
        kernel(heads)
    if not tails[0]:
        return
    sizes = [t.numel() for t in tails[0]]
    total = sum(sizes)
    packed = [ts[0].new_zeros(-(-total // VECTOR_RUN) * VECTOR_RUN) for ts in tails]
    for ts, buf in zip(tails, packed):
        torch.cat(ts, out=buf[:total])
    kernel([[buf] for buf in packed])
    for ts, buf in zip(tails, packed):  # the weights, the moments, and the unscaled gradients
        for t, part in zip(ts, buf[:total].split(sizes)):
            t.copy_(part)


@dataclass
class _Entry:
    name: str
    param: torch.Tensor
    start: int  # [start, end) of the flattened local tensor whose moments this rank keeps
    end: int
    decay: bool


class ShardedAdamW:
    """AdamW (decoupled weight decay, bias-corrected moments) over flat pieces of parameters.

    Without zero1 every rank keeps moments for whole parameters. With zero1 dp rank r keeps the moments of
    range r of its stage's flat space (`dp_pieces`). The arithmetic is elementwise, so both give the same
    result; only memory and traffic differ. State is keyed by global parameter name, never by position.

    `fused` (train.fused_adamw, the default wherever torch has the kernel): an in-place step is torch's fused
    AdamW kernel (`fused_adamw`, the kernel behind torch.optim.AdamW(fused=True)) over every piece at once, two
    calls (with and without decay), every element through its vector loop: the same bits whichever piece holds
    an element. Equal to the elementwise ops within float32 rounding (the kernel computes lr / bias-corrections
    in another order and unscales the gradient by dividing by 1 / grad_scale), tested to 1e-6 relative over
    several steps. A step after a `hold` (async checkpoint) copies each held tensor into its spare buffer and
    runs the same kernel there (one extra copy of the held state, in the step; bitwise the same update as
    without the hold).
    """

    def __init__(self, named_params: list, tp: Axis, dp: Axis, zero1: bool = False, betas=(0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0, bucket_mb: float = 25.0, fused: bool = False,
                 zero: int = 0, shards=None):
        level = max(int(zero), int(bool(zero1))) if dp.active else 0
        # zero1: the moments are cut over dp (any level >= 1; the checkpoint's word for it); per_tensor (zero
        # >= 2): cut tensor by tensor, as `shards` (parallel.zero.ShardedState) cuts gradients and weights
        self.tp, self.dp, self.zero1, self.fused = tp, dp, level >= 1, fused
        self.level, self.per_tensor, self.shards = level, level >= 2, shards if level >= 2 else None
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.step_count = 0
        self.entries: list[_Entry] = []
        self.exp_avg: dict[str, torch.Tensor] = {}
        self.exp_avg_sq: dict[str, torch.Tensor] = {}
        sizes = [(name, self.valid_numel(p), bool(partition_of(p).tied_to)) for name, p in named_params]
        pieces = dp_pieces(sizes, dp.rank, dp.size, self.per_tensor) if self.zero1 else \
            {n: (0, k) for n, k, _ in sizes}
        for name, p in named_params:
            a, b = pieces[name]
            # The layer that made the parameter decided (its tag): no decay on biases and LayerNorms.
            self.entries.append(_Entry(name, p, a, b, decay=partition_of(p).decay))
            self.exp_avg[name] = torch.zeros(b - a, dtype=torch.float32, device=p.device)
            self.exp_avg_sq[name] = torch.zeros(b - a, dtype=torch.float32, device=p.device)
        self._by_name = {e.name: e for e in self.entries}
        self._spaces = []  # zero 1 and 2: per flat space, its parameters and their start offsets (all-gather)
        if self.zero1 and level < 3:  # zero 3 keeps the weights cut: no all-gather after the step
            for space in flat_spaces(sizes, self.per_tensor):
                starts = list(itertools.accumulate([k for _, k in space], initial=0))
                self._spaces.append(([self._by_name[n].param for n, _ in space], starts))
        self._gather_elems = max(1, int(bucket_mb * 2**20 / 4 / dp.size))  # per rank per all-gather
        self.sent = {"all_gather": 0}  # bytes handed to collectives (as GradBuffer.sent)
        self._spare: dict[tuple[str, int], torch.Tensor] = {}  # zero-copy snapshots: see `hold`
        self.held: set[tuple[str, int]] = set()
        self._writer_wait, self._index = None, None

    def _grad(self, e: _Entry) -> torch.Tensor:
        """The gradient of the elements [start, end) this rank updates (zero >= 2: its shard, already them)."""
        return self.shards.grad(e.name) if self.shards else e.param.grad.view(-1)[e.start:e.end]

    def _weight(self, e: _Entry, w: torch.Tensor) -> torch.Tensor:
        """Elements [start, end) of the weight tensor `w` (zero 3: `w` is the shard, already them)."""
        return w if self.level >= 3 else w.view(-1)[e.start:e.end]

    def valid_numel(self, p) -> int:
        """Elements of the local tensor that belong to the global one: vocab padding rows sit at the end
        of dim 0, so the valid elements are a prefix of the flattened tensor and padding is never sharded."""
        return tp_box(partition_of(p), self.tp.rank, self.tp.size).numel

    @torch.no_grad()
    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        self.step_count += 1
        b1, b2 = self.betas
        bc1, bc2 = 1 - b1 ** self.step_count, 1 - b2 ** self.step_count
        held, self.held, self._writer_wait = self.held, set(), None
        if self.fused:
            for key in held:  # out of place: the held tensor stays the checkpoint's; the kernel updates a copy
                old = self._live(*key)
                self._spare_swap(*key).copy_(old)
            self._fused_step(lr, grad_scale)
            if self._spaces:
                self._all_gather()
            return
        for e in self.entries:
            w, m, v = (self._live(e.name, i) for i in range(3))
            w_new, m_new, v_new = (self._spare_swap(e.name, i) if (e.name, i) in held else x
                                   for i, x in enumerate((w, m, v)))
            if e.end == e.start:
                continue  # zero1: this rank owns none of it
            w, out = self._weight(e, w), self._weight(e, w_new)
            g = self._grad(e)
            if grad_scale != 1.0:
                g = g * grad_scale
            # The same elementwise kernels in place (out is the input) or out of place (after a hold).
            if e.decay and self.weight_decay:
                w = torch.mul(w, 1 - lr * self.weight_decay, out=out)
            torch.lerp(m, g, 1 - b1, out=m_new)
            torch.mul(v, b2, out=v_new).addcmul_(g, g, value=1 - b2)
            denom = (v_new.sqrt() / math.sqrt(bc2)).add_(self.eps)
            torch.addcdiv(w, m_new, denom, value=-lr / bc1, out=out)
        if self._spaces:
            self._all_gather()

    def _fused_step(self, lr: float, grad_scale: float) -> None:
        """The same update in place, by torch's fused kernel (`fused_adamw`): one call for the pieces with weight
        decay, one for those without (biases, LayerNorms)."""
        mine = [e for e in self.entries if e.end > e.start]
        if not mine:
            return
        dev = mine[0].param.device
        step = torch.tensor(float(self.step_count), device=dev)  # the kernel reads, never writes, the count
        # The kernel divides gradients by grad_scale (AMP's unscale) and writes them back: pass 1 / clip scale.
        scale = None if grad_scale == 1.0 else torch.tensor(1.0 / grad_scale, device=dev)
        for decay in (True, False):
            es = [e for e in mine if e.decay == decay]
            if es:
                fused_adamw([[self._weight(e, self._live(e.name, 0)) for e in es], [self._grad(e) for e in es],
                             [self.exp_avg[e.name] for e in es], [self.exp_avg_sq[e.name] for e in es]], step, lr,
                            self.betas, self.eps, self.weight_decay if decay else 0.0, scale)

    # ------------------------------------------------------------ zero-copy snapshots (async checkpoints)
    # A tensor is (name, i): i = 0 the parameter, 1 its exp_avg, 2 its exp_avg_sq.
    def _live(self, name: str, i: int) -> torch.Tensor:
        weight = self.shards.weight(name) if self.level >= 3 else self._by_name[name].param.data
        return (weight, self.exp_avg[name], self.exp_avg_sq[name])[i]

    def _spare_swap(self, name: str, i: int) -> torch.Tensor:
        """Make tensor (name, i)'s spare buffer the live one and keep the old one as the spare; return the
        new live buffer (its elements this step does not write are written by the all-gather: zero1)."""
        old, new = self._live(name, i), self._spare.pop((name, i), None)
        if new is None:  # not reserved at start-up
            new = torch.empty_like(old)
        self._spare[name, i], self._index = old, None
        if i == 0 and self.level >= 3:
            self.shards.weights[name] = new
        elif i == 0:
            self._by_name[name].param.data = new
        else:
            (self.exp_avg, self.exp_avg_sq)[i - 1][name] = new
        return new

    def holdable(self, t: torch.Tensor):
        """The tensor (name, i) that `t` is the whole of, if it is a host parameter or moment this
        optimizer writes; else None (a part of one, or device memory: a checkpoint copies those)."""
        if t.device.type != "cpu":
            return None
        if self._index is None:
            self._index = {}
            for e in self.entries:
                for i in range(3):
                    x = self._live(e.name, i)
                    self._index[x.data_ptr(), x.numel()] = (e.name, i)
        return self._index.get((t.data_ptr(), t.numel()))

    def reserve_spare(self, keys) -> None:
        """Allocate (and touch) the spare buffers of tensors `keys` now, at start-up, so that neither an
        async checkpoint nor the step after it pays for the allocation."""
        for key in keys:
            if key not in self._spare:
                self._spare[key] = torch.zeros_like(self._live(*key))

    def hold(self, keys, writer_wait=None) -> None:
        """A checkpoint is being written, in the background, straight from the live tensors `keys` (no
        copy). Nothing changes them in place from here: the next `step` computes the same update out of
        place, into their spare buffers, and makes those the live ones (`param.data` is swapped). The
        tensors it read stay the checkpoint's, and become the spares the step after the *next* hold writes
        into; the caller (AsyncSaver) waits for this checkpoint's writer before that next hold. Memory:
        one spare per held tensor, allocated once (`reserve_spare`), as a host staging buffer would be."""
        self.held |= set(keys)
        self._writer_wait = writer_wait

    def settle(self) -> None:
        """Before anything but `step` writes the parameters or moments in place (a load): if a checkpoint
        is still being written from them, wait for it."""
        if self.held and self._writer_wait is not None:
            self._writer_wait()

    @staticmethod
    def _views(space, lo: int, hi: int):
        """(flat view of a parameter, offset from lo) for the elements [lo, hi) of a flat space."""
        params, starts = space
        i = max(0, bisect.bisect_right(starts, lo) - 1)
        while i < len(params) and starts[i] < hi:
            a, b = max(lo, starts[i]), min(hi, starts[i + 1])
            if a < b:
                yield params[i].data.view(-1)[a - starts[i]:b - starts[i]], a - lo
            i += 1

    def _all_gather(self) -> None:
        """Every dp rank sends its updated range of each flat space, a window of it per collective (ranges
        are contiguous in the space, so a window of rank r's range is one run); all ranks copy every
        rank's window back into the parameters."""
        n = self.dp.size
        for space in self._spaces:
            total = space[1][-1]
            ranges = [shard_range(total, r, n) for r in range(n)]
            chunk = max(b - a for a, b in ranges)
            for w in range(0, chunk, self._gather_elems):
                size = min(self._gather_elems, chunk - w)
                spans = [(min(a + w, b), min(a + w + size, b)) for a, b in ranges]
                lo, hi = spans[self.dp.rank]
                mine = torch.zeros(size, dtype=torch.float32, device=space[0][0].device)
                for view, at in self._views(space, lo, hi):
                    mine[at:at + view.numel()] = view
                gathered = [torch.empty_like(mine) for _ in range(n)]
                dist.all_gather(gathered, mine, group=self.dp.group)
                self.sent["all_gather"] += n * mine.numel() * mine.element_size()
                for r, (lo, hi) in enumerate(spans):
                    for view, at in self._views(space, lo, hi):
                        view.copy_(gathered[r][at:at + view.numel()])

    def piece_of(self, name: str) -> tuple[int, int]:
        """The [start, end) of parameter `name`'s flattened valid elements whose moments this rank keeps
        ((0, 0) when it keeps none of them, with zero1)."""
        e = self._by_name[name]
        return e.start, e.end
