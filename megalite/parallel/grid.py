"""The parallel grid: every rank's (tp, cp, pp, dp) coordinate and the process groups it talks on.

Rank order (Megatron's): tp varies fastest, then cp, then dp, then pp
(rank = tp + TP * (cp + CP * (dp + DP * pp))), so the ranks of one tensor-parallel group are neighbours
(one machine, fast links), a context-parallel ring comes next, and pipeline stages are furthest apart.
With cp = 1 (the default) this is rank = tp + TP * (dp + DP * pp), as before cp existed.

    8 ranks, tp=2 pp=2 dp=2:          pp stage 0          pp stage 1
                                   dp0      dp1        dp0      dp1
                          tp0      r0       r2         r4       r6
                          tp1      r1       r3         r5       r7

    8 ranks, tp=2 cp=2 dp=2:               dp0                 dp1
                                       cp0      cp1        cp0      cp1
                          tp0          r0       r2         r4       r6
                          tp1          r1       r3         r5       r7

Context parallelism (cp) splits every sequence over a ring of cp ranks (parallel/context.py); they hold the
same weights, so their gradients are averaged, with the dp replicas', over one dp x cp group (`dp_cp`), and
ZeRO-1 and the checkpoint's write plan cut a stage's tensors over that group.

The maths (`coord_of`, `rank_of`, `*_ranks`) needs no process group and is unit-tested alone. A grid is
an object passed to whatever needs it; nothing here is global, so two grids can live in one process.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch.distributed as dist

from ..base.errors import LayoutError


class Coord(NamedTuple):
    tp: int
    pp: int
    dp: int
    cp: int = 0  # trailing, with a default: Coord(tp, pp, dp) is a coordinate of a cp = 1 layout


@dataclass
class Axis:
    """One parallel axis as seen from this rank: its size, our index along it, and the group."""
    size: int
    rank: int
    group: Optional[object] = None  # a torch.distributed ProcessGroup; None when size == 1 or no dist

    @property
    def active(self) -> bool:
        return self.size > 1


class Layout(tuple):
    """The sizes of the parallel axes: Layout(tp, pp, dp) or Layout(tp, pp, dp, cp).

    cp is a trailing field with a default of 1, and a cp = 1 layout is the (tp, pp, dp) triple megalite always had:
    as a tuple it holds three numbers (equal to (tp, pp, dp), unpacking into three, in manifests and messages),
    four only when cp > 1. Read the sizes by name (`.tp`, `.cp`, ...), which works for both."""
    __slots__ = ()

    def __new__(cls, tp, pp, dp, cp=1):
        return super().__new__(cls, (tp, pp, dp) if cp == 1 and type(cp) is int else (tp, pp, dp, cp))

    def __getnewargs__(self):  # pickling (all_gather_object, run_parallel's arguments)
        return tuple(self)

    tp = property(lambda self: self[0])
    pp = property(lambda self: self[1])
    dp = property(lambda self: self[2])
    cp = property(lambda self: self[3] if len(self) > 3 else 1)

    def __repr__(self) -> str:
        return f"Layout(tp={self.tp}, pp={self.pp}, dp={self.dp}{f', cp={self.cp}' if len(self) > 3 else ''})"

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def coord_of(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        tp = rank % self.tp
        cp = (rank // self.tp) % self.cp
        dp = (rank // (self.tp * self.cp)) % self.dp
        pp = rank // (self.tp * self.cp * self.dp)
        return Coord(tp, pp, dp, cp)

    def rank_of(self, coord) -> int:
        tp, pp, dp, *cp = coord  # a plain (tp, pp, dp) tuple is a cp = 0 coordinate
        return tp + self.tp * ((cp[0] if cp else 0) + self.cp * (dp + self.dp * pp))

    def replica(self, c: Coord) -> int:
        """c's index among the dp x cp ranks that hold the same (tp, pp) slice of the model (its rank in the
        `dp_cp` group): where ZeRO-1 and the checkpoint's write plan cut that slice (cp = 1: the dp rank)."""
        return c.cp + self.cp * c.dp

    @property
    def replicas(self) -> int:
        """How many ranks hold each (tp, pp) slice of the model: dp x cp."""
        return self.dp * self.cp

    def coords(self) -> list[Coord]:
        return [self.coord_of(r) for r in range(self.world_size)]

    # The member ranks of the group along each axis that contains `coord`.
    def tp_ranks(self, c: Coord) -> list[int]:
        return [self.rank_of(c._replace(tp=t)) for t in range(self.tp)]

    def cp_ranks(self, c: Coord) -> list[int]:
        """The context-parallel ring: the ranks that share c's sequences, each holding 2 of their 2cp chunks."""
        return [self.rank_of(c._replace(cp=k)) for k in range(self.cp)]

    def dp_ranks(self, c: Coord) -> list[int]:
        return [self.rank_of(c._replace(dp=d)) for d in range(self.dp)]

    def dp_cp_ranks(self, c: Coord) -> list[int]:
        """Megatron's data-parallel group with context parallelism: every rank holding c's (tp, pp) slice of
        the model, in rank order (index `replica`): gradients are averaged and ZeRO-1 cuts over it."""
        return sorted(self.rank_of(c._replace(dp=d, cp=k)) for d in range(self.dp) for k in range(self.cp))

    def shard_ranks(self, c: Coord, shard: int) -> list[int]:
        """Hybrid sharding (parallel.dp_shard = shard): c's group of `shard` consecutive members of its dp x cp
        group (by `replica`), inside which ZeRO-2 and 3 cut every tensor."""
        members, r = self.dp_cp_ranks(c), self.replica(c)
        return members[r - r % shard:r - r % shard + shard]

    def replicate_ranks(self, c: Coord, shard: int) -> list[int]:
        """Hybrid sharding: the members of c's dp x cp group at c's place in every shard group (they hold the
        same chunks: their reduced chunks are all-reduced)."""
        return self.dp_cp_ranks(c)[self.replica(c) % shard::shard]

    def pp_ranks(self, c: Coord) -> list[int]:
        return [self.rank_of(c._replace(pp=p)) for p in range(self.pp)]

    def mp_ranks(self, c: Coord) -> list[int]:
        """Model-parallel group: all tp and pp ranks of one (dp, cp) replica (one whole copy of the model)."""
        return sorted(self.rank_of(c._replace(tp=t, pp=p)) for t in range(self.tp) for p in range(self.pp))

    def stage_ranks(self, c: Coord) -> list[int]:
        """Every rank of c's pipeline stage (all its tp, cp and dp ranks); the first is the stage's leader."""
        return sorted(self.rank_of(Coord(t, c.pp, d, k)) for t in range(self.tp) for d in range(self.dp)
                      for k in range(self.cp))

    def leader_ranks(self) -> list[int]:
        """The first rank of every pipeline stage (rank 0 leads stage 0)."""
        return [self.rank_of(Coord(0, p, 0)) for p in range(self.pp)]

    def embed_ranks(self, c: Coord) -> list[int]:
        """First and last pipeline stage: they hold the two copies of the tied token embedding."""
        return sorted({self.rank_of(c._replace(pp=0)), self.rank_of(c._replace(pp=self.pp - 1))})

    def validate(self, model=None, prefix: str = "parallel.") -> "Layout":
        """The one definition of a valid layout: positive integer sizes, and, given the model config
        (a ModelConfig or its dict), tp dividing n_head and no more pipeline stages than layers.
        Raises LayoutError naming the field as the caller spells it (`parallel.tp`, `--tp`, `layout.tp`)."""
        sep = " " if prefix.startswith("--") else " = "
        for axis in ("tp", "pp", "dp", "cp"):
            v = getattr(self, axis)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise LayoutError(f"{prefix}{axis}{sep}{v!r}: must be a positive integer")
        if model is None:
            return self
        get = model.get if isinstance(model, dict) else (lambda k: getattr(model, k, None))
        n_head, n_layer = get("n_head"), get("n_layer")
        if isinstance(n_head, int) and n_head > 0 and n_head % self.tp:
            raise LayoutError(f"{prefix}tp{sep}{self.tp} does not divide model.n_head = {n_head}")
        kv = get("n_kv_head") or n_head  # 0: one kv head per query head (every family without GQA)
        if isinstance(kv, int) and isinstance(n_head, int) and kv > 0 and kv % self.tp and self.tp % kv:
            raise LayoutError(f"{prefix}tp{sep}{self.tp} neither divides model.n_kv_head = {kv} nor is a "
                              f"multiple of it (kv heads are split across tp, or each shared by tp/n_kv_head "
                              f"ranks)")
        ffn = get("intermediate_size")
        if isinstance(ffn, int) and ffn > 0 and ffn % self.tp:
            raise LayoutError(f"{prefix}tp{sep}{self.tp} does not divide model.intermediate_size = {ffn}")
        if isinstance(n_layer, int) and self.pp > n_layer:
            raise LayoutError(f"{prefix}pp{sep}{self.pp} is larger than model.n_layer = {n_layer} "
                              f"(every pipeline stage needs at least one layer)")
        return self

    def __str__(self) -> str:  # cp is named only when it is used: cp = 1 layouts read as they always did
        return f"tp={self.tp} {f'cp={self.cp} ' if self.cp != 1 else ''}pp={self.pp} dp={self.dp}"


class ParallelGrid:
    """This rank's place in a Layout plus its process groups.

    Build with `ParallelGrid.create(layout)` after `dist.init_process_group`, or `ParallelGrid.single()`
    for one plain process (no torch.distributed at all: generation, conversion, unit tests).
    """

    def __init__(self, layout: Layout, rank: int, tp: Axis, pp: Axis, dp: Axis, mp: Axis, embed: Axis,
                 world: Optional[object] = None, cpu: Optional[object] = None, cp: Optional[Axis] = None,
                 dp_cp: Optional[Axis] = None, timeout=None):
        self.layout, self.rank = layout, rank
        self.coord = layout.coord_of(rank)
        self.tp, self.pp, self.dp, self.mp, self.embed = tp, pp, dp, mp, embed
        self.cp = cp or Axis(1, 0)  # the context-parallel ring (parallel/context.py)
        self.dp_cp = dp_cp or dp  # every rank holding this (tp, pp) slice: the gradient mean and ZeRO-1 cut
        self.world = world  # the default group; None for single()
        self.cpu = cpu  # a gloo group over all ranks for small host-side values (loss, stop flag, agreement)
        self.timeout = timeout  # what the groups were made with; a group made later (the commit's) uses it too

    @classmethod
    def single(cls) -> "ParallelGrid":
        one = Axis(1, 0)
        return cls(Layout(1, 1, 1), 0, one, one, one, one, one)

    @classmethod
    def create(cls, layout: Layout, timeout=None) -> "ParallelGrid":
        """Create every group of every axis (all ranks must call new_group for all groups, in order).
        `timeout` (a timedelta): how long their collectives wait for a silent peer (torch's default: 30 min)."""
        layout.validate()
        rank, world = dist.get_rank(), dist.get_world_size()
        if world != layout.world_size:
            raise ValueError(f"world size {world} != tp*cp*pp*dp of {layout}")
        axes = {}
        # cp = 1: the cp groups are all of size 1 (no group made) and dp x cp is dp (the same Axis, below)
        every = [("tp", layout.tp_ranks), ("cp", layout.cp_ranks), ("pp", layout.pp_ranks), ("dp", layout.dp_ranks),
                 ("mp", layout.mp_ranks), ("embed", layout.embed_ranks)]
        for name, members_of in every + ([("dp_cp", layout.dp_cp_ranks)] if layout.cp > 1 else []):
            seen = []
            for c in layout.coords():
                members = members_of(c)
                if members in seen:
                    continue
                seen.append(members)
                group = dist.new_group(members, timeout=timeout) if len(members) > 1 else None
                if rank in members:
                    axes[name] = Axis(len(members), members.index(rank), group)
        axes.setdefault("embed", Axis(1, 0))  # middle pipeline stages hold no embedding copy
        cpu = dist.new_group(backend="gloo", timeout=timeout)
        return cls(layout, rank, world=dist.group.WORLD, cpu=cpu, timeout=timeout, **axes)

    def hybrid(self, shard: int) -> tuple[Axis, Axis]:
        """(shard, replicate) axes for ZeRO-2 and 3 with parallel.dp_shard = `shard` (0: the whole dp x cp
        group, no replication). Makes groups: every rank calls it, with the same `shard`."""
        if shard in (0, self.dp_cp.size):
            return self.dp_cp, Axis(1, 0)
        axes = {}
        for name, members_of in (("shard", self.layout.shard_ranks), ("replicate", self.layout.replicate_ranks)):
            seen = []
            for c in self.layout.coords():
                members = members_of(c, shard)
                if members in seen:
                    continue
                seen.append(members)
                group = dist.new_group(members, timeout=self.timeout) if len(members) > 1 else None
                if self.rank in members:
                    axes[name] = Axis(len(members), members.index(self.rank), group)
        return axes["shard"], axes["replicate"]

    # Pipeline neighbours, as global ranks for point-to-point sends.
    @property
    def is_first_stage(self) -> bool:
        return self.coord.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coord.pp == self.layout.pp - 1

    @property
    def prev_rank(self) -> int:
        return self.layout.rank_of(self.coord._replace(pp=self.coord.pp - 1))

    @property
    def next_rank(self) -> int:
        return self.layout.rank_of(self.coord._replace(pp=self.coord.pp + 1))

    def __repr__(self) -> str:
        c = self.coord
        cp = f" cp{c.cp}" if self.layout.cp > 1 else ""
        return f"ParallelGrid({self.layout}; rank {self.rank} = tp{c.tp}{cp} pp{c.pp} dp{c.dp})"
