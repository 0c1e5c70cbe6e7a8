"""The parallel grid: every rank's (tp, pp, dp) coordinate and the process groups it talks on.

Rank order: tp varies fastest, then dp, then pp (rank = tp + TP * (dp + DP * pp)), so the ranks of one
tensor-parallel group are neighbours (one machine, fast links) and pipeline stages are furthest apart.

    8 ranks, tp=2 pp=2 dp=2:          pp stage 0          pp stage 1
                                   dp0      dp1        dp0      dp1
                          tp0      r0       r2         r4       r6
                          tp1      r1       r3         r5       r7

The maths (`coord_of`, `rank_of`, `*_ranks`) needs no process group and is unit-tested alone. A grid is
an object passed to whatever needs it; nothing here is global, so two grids can live in one process.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch.distributed as dist

from ..errors import LayoutError


class Coord(NamedTuple):
    tp: int
    pp: int
    dp: int


@dataclass
class Axis:
    """One parallel axis as seen from this rank: its size, our index along it, and the group."""
    size: int
    rank: int
    group: Optional[object] = None  # a torch.distributed ProcessGroup; None when size == 1 or no dist

    @property
    def active(self) -> bool:
        return self.size > 1


class Layout(NamedTuple):
    tp: int
    pp: int
    dp: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coord_of(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        pp = rank // (self.tp * self.dp)
        return Coord(tp, pp, dp)

    def rank_of(self, coord: Coord) -> int:
        tp, pp, dp = coord
        return tp + self.tp * (dp + self.dp * pp)

    def coords(self) -> list[Coord]:
        return [self.coord_of(r) for r in range(self.world_size)]

    # The member ranks of the group along each axis that contains `coord`.
    def tp_ranks(self, c: Coord) -> list[int]:
        return [self.rank_of(Coord(t, c.pp, c.dp)) for t in range(self.tp)]

    def dp_ranks(self, c: Coord) -> list[int]:
        return [self.rank_of(Coord(c.tp, c.pp, d)) for d in range(self.dp)]

    def pp_ranks(self, c: Coord) -> list[int]:
        return [self.rank_of(Coord(c.tp, p, c.dp)) for p in range(self.pp)]

    def mp_ranks(self, c: Coord) -> list[int]:
        """Model-parallel group: all tp and pp ranks of one dp replica (one whole copy of the model)."""
        return sorted(self.rank_of(Coord(t, p, c.dp)) for t in range(self.tp) for p in range(self.pp))

    def stage_ranks(self, c: Coord) -> list[int]:
        """Every rank of c's pipeline stage (all its tp and dp ranks); the first is the stage's leader."""
        return sorted(self.rank_of(Coord(t, c.pp, d)) for t in range(self.tp) for d in range(self.dp))

    def leader_ranks(self) -> list[int]:
        """The first rank of every pipeline stage (rank 0 leads stage 0)."""
        return [self.rank_of(Coord(0, p, 0)) for p in range(self.pp)]

    def embed_ranks(self, c: Coord) -> list[int]:
        """First and last pipeline stage: they hold the two copies of the tied token embedding."""
        return sorted({self.rank_of(Coord(c.tp, 0, c.dp)), self.rank_of(Coord(c.tp, self.pp - 1, c.dp))})

    def validate(self, model=None, prefix: str = "parallel.") -> "Layout":
        """The one definition of a valid layout: positive integer sizes, and, given the model config
        (a ModelConfig or its dict), tp dividing n_head and no more pipeline stages than layers.
        Raises LayoutError naming the field as the caller spells it (`parallel.tp`, `--tp`, `layout.tp`)."""
        sep = " " if prefix.startswith("--") else " = "
        for axis in ("tp", "pp", "dp"):
            v = getattr(self, axis)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise LayoutError(f"{prefix}{axis}{sep}{v!r}: must be a positive integer")
        if model is None:
            return self
        get = model.get if isinstance(model, dict) else (lambda k: getattr(model, k, None))
        n_head, n_layer = get("n_head"), get("n_layer")
        if isinstance(n_head, int) and n_head > 0 and n_head % self.tp:
            raise LayoutError(f"{prefix}tp{sep}{self.tp} does not divide model.n_head = {n_head}")
        if isinstance(n_layer, int) and self.pp > n_layer:
            raise LayoutError(f"{prefix}pp{sep}{self.pp} is larger than model.n_layer = {n_layer} "
                              f"(every pipeline stage needs at least one layer)")
        return self

    def __str__(self) -> str:
        return f"tp={self.tp} pp={self.pp} dp={self.dp}"


class ParallelGrid:
    """This rank's place in a Layout plus its process groups.

    Build with `ParallelGrid.create(layout)` after `dist.init_process_group`, or `ParallelGrid.single()`
    for one plain process (no torch.distributed at all: generation, conversion, unit tests).
    """

    def __init__(self, layout: Layout, rank: int, tp: Axis, pp: Axis, dp: Axis, mp: Axis, embed: Axis,
                 world: Optional[object] = None, cpu: Optional[object] = None, aux: Optional[object] = None,
                 aux_stage: Optional[Axis] = None, aux_leaders: Optional[Axis] = None):
        self.layout, self.rank = layout, rank
        self.coord = layout.coord_of(rank)
        self.tp, self.pp, self.dp, self.mp, self.embed = tp, pp, dp, mp, embed
        self.world = world  # the default group; None for single()
        self.cpu = cpu  # a gloo group over all ranks for small host-side values (loss, stop flag)
        self.aux = aux  # another gloo group, used only by background work (async checkpoint commits)
        # Background-only gloo groups for the commit's two-level gather: this rank's pipeline stage (rank 0 of
        # the Axis is the stage's leader), and the stage leaders (size 1 on every other rank).
        self.aux_stage = aux_stage or Axis(1, 0)
        self.aux_leaders = aux_leaders or Axis(1, 0)

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
            raise ValueError(f"world size {world} != tp*pp*dp of {layout}")
        axes = {}
        for name, members_of in [("tp", layout.tp_ranks), ("pp", layout.pp_ranks), ("dp", layout.dp_ranks),
                                 ("mp", layout.mp_ranks), ("embed", layout.embed_ranks)]:
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
        aux = dist.new_group(backend="gloo", timeout=timeout)
        for name, groups in [("aux_stage", [layout.stage_ranks(layout.coord_of(r)) for r in layout.leader_ranks()]),
                             ("aux_leaders", [layout.leader_ranks()])]:
            for members in groups:
                if len(members) > 1:
                    group = dist.new_group(members, backend="gloo", timeout=timeout)
                    if rank in members:
                        axes[name] = Axis(len(members), members.index(rank), group)
        return cls(layout, rank, world=dist.group.WORLD, cpu=cpu, aux=aux, **axes)

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
        return f"ParallelGrid({self.layout}; rank {self.rank} = tp{c.tp} pp{c.pp} dp{c.dp})"
