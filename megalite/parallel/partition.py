"""The partition tag: how each parameter is laid out across the grid, set once and read by everything.

Every parameter is tagged once with its global shape, the dim it is split on across tp (or None:
replicated), which pipeline stage owns it and what it is tied to. Init, grad-norm, ZeRO, checkpoints and
the converter all read the tag; nothing infers a split from a parameter's name. `Box` is the one home of
slice arithmetic (a region of a global tensor); `init_local` initialises the full tensor from the seed and
keeps this rank's slice, so every layout starts from the same model.
"""
from __future__ import annotations

import functools
import itertools
import math
import operator
import zlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from .grid import Axis


@dataclass(frozen=True)
class Partition:
    """How one parameter is laid out across the grid.

    global_shape: the shape of the whole tensor (vocab rows unpadded).
    dim: the dim split across tp ranks (ceil-sized chunks, the last possibly short: vocab padding),
         or None when every tp rank holds a full replica.
    tied_to: global name of the parameter this one is a copy of (the LM head on the last pipeline stage
             is a copy of `wte.weight`); tied copies are never saved, only loaded from their source.
    placement: which pipeline stage owns it: "first", "last", or "layer.<i>" (the stage holding layer i);
             `pipeline.stage_of` turns it into a stage index for any pp.
    init: how `init_weights` fills it, set at construction: "normal", "scaled" (std / sqrt(2 n_layer),
          GPT-2's residual projections), "ones" or "zeros".
    tied: part of a tie (the source or a copy): its gradient is summed over the grid's `embed` group so
          that every copy takes the same step.
    decay: whether AdamW applies weight decay to it (GPT-2 / nanoGPT: matrices and embeddings yes; biases
             and LayerNorm parameters no, whatever their shape: the fused QKV bias is (3, C)). Set by the layer
             that creates the parameter; an optimizer setting, so not stored in the manifest.
    units: 0, or the number of indivisible blocks `dim` is made of (a k/v projection's kv heads, GQA): tp
           never cuts a block, so with tp > units each block is held whole by tp/units consecutive tp ranks
           (Megatron's replicated query groups) and their gradients are summed over those ranks
           (finalize.py); with tp <= units it is an ordinary split (units % tp == 0: config.validate).
    tp_partial: replicated (dim None) but each tp rank computes only its part of the gradient (a norm shared by
           every attention head, each rank holding other heads: a per-head q/k norm): summed over tp
           (finalize.py), as sequence parallelism sums every replicated parameter.
    """
    global_shape: tuple
    dim: Optional[int] = None
    tied_to: Optional[str] = None
    placement: str = "first"
    init: str = "normal"
    tied: bool = False
    decay: bool = True
    units: int = 0
    tp_partial: bool = False

    def to_json(self) -> dict:  # `units` only where set: every GPT-2 manifest reads as it always did
        return {"dim": self.dim, "tied_to": self.tied_to, "placement": self.placement,
                **({"units": self.units} if self.units else {})}

    @classmethod
    def from_json(cls, shape, d: dict) -> "Partition":
        return cls(tuple(shape), d.get("dim"), d.get("tied_to"), d.get("placement", "first"),
                   units=d.get("units", 0))


class Box(tuple):
    """A region of a global tensor, ((start, end) per dim), half-open: the one home of slice arithmetic.

    A tuple, so it is hashable, compares by value and serialises as [[start, end], ...]."""

    def __new__(cls, ranges):
        return super().__new__(cls, tuple((int(a), int(b)) for a, b in ranges))

    @classmethod
    def whole(cls, shape) -> "Box":
        return cls((0, n) for n in shape)

    @property
    def shape(self) -> tuple:
        return tuple(b - a for a, b in self)

    @property
    def numel(self) -> int:
        return math.prod(b - a for a, b in self)

    def intersect(self, other) -> Optional["Box"]:
        """The common region, or None when it is empty."""
        out = Box((max(a, c), min(b, d)) for (a, b), (c, d) in zip(self, other))
        return out if all(a < b for a, b in out) else None

    def within(self, outer: "Box") -> tuple:
        """This box as an index (slices) into a tensor holding `outer`."""
        return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(self, outer))

    def rows_holding(self, a: int, b: int) -> "Box":
        """The whole dim-0 rows of this box that hold its row-major elements [a, b) (a < b)."""
        row = math.prod(self.shape[1:])
        (s, _), rest = self[0], self[1:]
        return Box(((s + a // row, s + -(-b // row)), *rest))

    def span_within(self, outer: "Box") -> tuple[int, int]:
        """[first, last + 1) of the row-major elements of a tensor holding `outer` that this box touches."""
        st = list(itertools.accumulate(reversed(outer.shape[1:]), operator.mul, initial=1))[::-1]
        lo = sum((a - o) * k for (a, _), (o, _), k in zip(self, outer, st))
        return lo, sum((b - 1 - o) * k for (_, b), (o, _), k in zip(self, outer, st)) + 1

    @property
    def index(self) -> tuple:
        """This box as an index (slices) into the global tensor."""
        return tuple(slice(a, b) for a, b in self)

    def to_json(self) -> list:
        return [[a, b] for a, b in self]


def shard_range(n: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of chunk `rank` when n items are cut into `size` ceil-sized chunks (last may be short)."""
    chunk = math.ceil(n / size)
    start = min(rank * chunk, n)
    return start, min(start + chunk, n)


def _cuts(p: Partition, tp_size: int) -> int:
    """Into how many distinct pieces tp cuts the split dim: tp, or `units` when tp > units (blocks shared)."""
    return min(tp_size, p.units) if p.units else tp_size


def local_shape(p: Partition, tp_size: int) -> tuple:
    """Shape of the local tensor: the split dim holds ceil(n / tp) rows (zero padding on the last rank)."""
    shape = list(p.global_shape)
    if p.dim is not None:
        shape[p.dim] = math.ceil(shape[p.dim] / _cuts(p, tp_size))
    return tuple(shape)


def tp_replicas(p: Partition, tp_size: int) -> int:
    """How many tp ranks hold each piece of the tensor: tp (replicated), tp/units (shared kv heads), or 1."""
    return tp_size if p.dim is None else tp_size // _cuts(p, tp_size)


def tp_replica(p: Partition, tp_rank: int, tp_size: int) -> int:
    """This tp rank's index among the ranks that hold the same piece (0: the one that counts it in the grad
    norm; the replicas of a piece are consecutive tp ranks)."""
    return tp_rank % tp_replicas(p, tp_size)


@functools.lru_cache(maxsize=1 << 16)
def tp_box(p: Partition, tp_rank: int, tp_size: int) -> Box:
    """The region of the global tensor that a tp rank holds (its valid part). Cached: planning a save
    asks it for every tensor of a stage, and a Box is immutable."""
    box = [(0, n) for n in p.global_shape]
    if p.dim is not None:
        box[p.dim] = shard_range(p.global_shape[p.dim], tp_rank // tp_replicas(p, tp_size), _cuts(p, tp_size))
    return Box(box)


def tag(param: nn.Parameter, partition: Partition) -> nn.Parameter:
    """Give a parameter its partition tag, once, where it is made (the layer that creates it knows its split,
    stage, init and ties). A second tag raises: everything from init to the checkpoint has read the first,
    so a later change would leave them disagreeing (nanotron's parameter metadata is written once alike)."""
    if hasattr(param, "partition"):
        raise ValueError(f"parameter of shape {tuple(param.shape)} is already tagged ({_describe(param.partition)}); "
                         f"a partition tag is set once, at construction")
    param.partition = partition
    return param


def _describe(p: Partition) -> str:
    split = "replicated" if p.dim is None else f"split on dim {p.dim}"
    return f"global shape {p.global_shape} {split}, placement {p.placement!r}"


def partition_of(param: torch.Tensor) -> Partition:
    """The parameter's tag. An untagged parameter (a plain torch.nn module's) is replicated: its global
    shape is its local shape, every tp and dp rank holds all of it, and its stage is whichever rank holds it."""
    try:
        return param.partition
    except AttributeError:
        return Partition(tuple(param.shape))


def shard(param: nn.Parameter, dim: int, tp: Axis) -> nn.Parameter:
    """Split a parameter of your own module across tensor-parallel ranks: the one public way to tag one.

    `param` holds the *whole* tensor (build the full module from the same seed on every rank); this keeps
    tp rank r's chunk r of `dim` in place (param.data becomes that slice), tags it with its global shape and
    split dim, and returns it. Do it before creating the optimizer. Checkpoints then store the parameter,
    and every optimizer state tensor of its shape, as one global tensor that any tp size can load. Untagged
    parameters are replicated. Your forward does the communication, e.g. copy_to_tp before and
    gather_from_tp after a Linear split on its output dim (what ColumnParallelLinear does).
    """
    if not isinstance(dim, int) or isinstance(dim, bool) or not 0 <= dim < param.dim():
        raise ValueError(f"shard: dim {dim!r} is not a dim of a parameter of shape {tuple(param.shape)}")
    if hasattr(param, "partition"):
        raise ValueError(f"shard: the parameter of shape {tuple(param.shape)} is already tagged "
                         f"(split on dim {param.partition.dim} with global shape {param.partition.global_shape})")
    n = param.shape[dim]
    if n % tp.size:
        raise ValueError(f"shard: dim {dim} of shape {tuple(param.shape)} ({n}) does not divide by tp = {tp.size}")
    part = Partition(tuple(param.shape), dim=dim)
    with torch.no_grad():
        param.data = param.data[tp_box(part, tp.rank, tp.size).index].clone()
    return tag(param, part)


def valid_view(t: torch.Tensor, p: Partition, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The local tensor without its padding rows (what a checkpoint stores)."""
    if p.dim is None:
        return t
    return t.narrow(p.dim, 0, tp_box(p, tp_rank, tp_size).shape[p.dim])


def init_local(name: str, p: Partition, init: str, seed: int, std: float, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Initialise the *full* tensor from (seed, global name), keep this rank's slice, pad with zeros.

    Seeding by name makes every layout, and every stage assignment of the layers, start from the same model.
    """
    if init == "ones":
        full = torch.ones(p.global_shape)
    elif init == "zeros":
        full = torch.zeros(p.global_shape)
    else:
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        full = torch.empty(p.global_shape).normal_(0.0, std, generator=g)
    box = tp_box(p, tp_rank, tp_size)
    local = torch.zeros(local_shape(p, tp_size))
    local[tuple(slice(0, n) for n in box.shape)] = full[box.index]
    return local
