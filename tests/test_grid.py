"""Grid maths (no process groups): rank <-> coordinate, group members, layer split, shard ranges."""
import itertools

import pytest

from megalite.parallel.grid import Axis, Coord, Layout, ParallelGrid
from megalite.parallel.pipeline import num_warmup_microbatches, partition_layers
from megalite.parallel.partition import Partition, local_shape, shard_range, tp_box

LAYOUTS = [Layout(tp, pp, dp) for tp, pp, dp in itertools.product([1, 2, 3, 4], [1, 2, 3], [1, 2, 4])]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_coord_rank_inverse(layout):
    coords = layout.coords()
    assert len(coords) == layout.world_size == layout.tp * layout.pp * layout.dp
    assert len(set(coords)) == layout.world_size  # a bijection
    for rank, c in enumerate(coords):
        assert 0 <= c.tp < layout.tp and 0 <= c.pp < layout.pp and 0 <= c.dp < layout.dp
        assert layout.rank_of(c) == rank
    for c in itertools.product(range(layout.tp), range(layout.pp), range(layout.dp)):
        assert layout.coord_of(layout.rank_of(Coord(*c))) == Coord(*c)


def test_rank_order_tp_fastest_then_dp_then_pp():
    lay = Layout(tp=2, pp=2, dp=2)
    expected = {0: (0, 0, 0), 1: (1, 0, 0), 2: (0, 0, 1), 3: (1, 0, 1),
                4: (0, 1, 0), 5: (1, 1, 0), 6: (0, 1, 1), 7: (1, 1, 1)}  # (tp, pp, dp)
    for rank, c in expected.items():
        assert lay.coord_of(rank) == Coord(*c), rank
    assert lay.coord_of(3) == Coord(tp=1, pp=0, dp=1)
    assert lay.coord_of(4) == Coord(tp=0, pp=1, dp=0)
    lay = Layout(tp=4, pp=2, dp=3)
    assert lay.rank_of(Coord(tp=3, pp=1, dp=2)) == 3 + 4 * (2 + 3 * 1)
    assert [lay.coord_of(r).tp for r in range(8)] == [0, 1, 2, 3] * 2
    assert [lay.coord_of(r).dp for r in range(0, 24, 4)] == [0, 1, 2, 0, 1, 2]
    assert [lay.coord_of(r).pp for r in range(0, 24, 12)] == [0, 1]


@pytest.mark.parametrize("rank", [-1, 8, 100])
def test_coord_of_out_of_range(rank):
    with pytest.raises(ValueError):
        Layout(2, 2, 2).coord_of(rank)


def test_group_members_2x2x2():
    lay = Layout(tp=2, pp=2, dp=2)
    for rank, want in ((3, dict(tp=[2, 3], dp=[1, 3], pp=[3, 7], mp=[2, 3, 6, 7], embed=[3, 7])),  # tp1 pp0 dp1
                       (4, dict(tp=[4, 5], dp=[4, 6], pp=[0, 4], mp=[0, 1, 4, 5], embed=[0, 4]))):  # tp0 pp1 dp0
        c = lay.coord_of(rank)
        for group, members in want.items():
            assert getattr(lay, f"{group}_ranks")(c) == members, (rank, group)


def test_group_members_other_layouts():
    lay = Layout(tp=1, pp=4, dp=2)
    c = lay.coord_of(5)  # dp1 pp2
    assert c == Coord(0, 2, 1)
    assert lay.pp_ranks(c) == [1, 3, 5, 7]
    assert lay.dp_ranks(c) == [4, 5]
    assert lay.tp_ranks(c) == [5]
    assert lay.mp_ranks(c) == [1, 3, 5, 7]
    assert lay.embed_ranks(c) == [1, 7]  # first and last stage only
    lay = Layout(tp=2, pp=1, dp=4)
    c = lay.coord_of(5)
    assert lay.embed_ranks(c) == [5]  # one stage: a single copy of the embedding
    assert lay.pp_ranks(c) == [5]
    assert lay.dp_ranks(c) == [1, 3, 5, 7]
    assert lay.mp_ranks(c) == [4, 5]
    assert lay.stage_ranks(c) == list(range(8)) and lay.leader_ranks() == [0]


def test_stage_and_leader_ranks_for_the_commit_gather():
    lay = Layout(tp=2, pp=3, dp=2)  # 4 ranks a stage, consecutive (tp fastest, then dp, then pp)
    assert [lay.stage_ranks(lay.coord_of(r)) for r in (0, 5, 11)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert lay.leader_ranks() == [0, 4, 8]  # each stage's first rank; rank 0 leads stage 0


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_groups_partition_the_world(layout):
    """Along every axis the groups are disjoint, cover all ranks, have the axis' size, and vary only
    that axis' coordinate; mp groups are one dp replica each."""
    for name, size in [("tp", layout.tp), ("pp", layout.pp), ("dp", layout.dp), ("mp", layout.tp * layout.pp)]:
        members_of = getattr(layout, f"{name}_ranks")
        groups = {tuple(members_of(c)) for c in layout.coords()}
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(layout.world_size)), name
        for rank, c in enumerate(layout.coords()):
            g = members_of(c)
            assert rank in g and len(g) == size
            others = {"tp": ("pp", "dp"), "pp": ("tp", "dp"), "dp": ("tp", "pp"), "mp": ("dp",)}[name]
            for r in g:
                for f in others:
                    assert getattr(layout.coord_of(r), f) == getattr(c, f)
    for c in layout.coords():
        e = layout.embed_ranks(c)
        assert {layout.coord_of(r).pp for r in e} == {0, layout.pp - 1}
        assert all(layout.coord_of(r)._replace(pp=0) == c._replace(pp=0) for r in e)


def test_single_grid_and_axis():
    g = ParallelGrid.single()
    assert g.layout == Layout(1, 1, 1) and g.rank == 0
    assert g.is_first_stage and g.is_last_stage
    assert not any(a.active for a in (g.tp, g.pp, g.dp, g.mp, g.embed))
    assert Axis(2, 1).active and not Axis(1, 0).active
    assert Layout(2, 3, 4).world_size == 24


def _check_partition(n_layer, pp, parts):
    assert len(parts) == pp
    assert parts[0].start == 0 and parts[-1].stop == n_layer
    for a, b in zip(parts, parts[1:]):
        assert a.stop == b.start  # contiguous
    sizes = [len(r) for r in parts]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # extra layers go to the earlier stages
    assert [i for r in parts for i in r] == list(range(n_layer))


def test_partition_layers():
    assert partition_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert partition_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert partition_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert partition_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    assert partition_layers(3, 1) == [range(0, 3)]
    for n_layer in range(1, 13):
        for pp in range(1, n_layer + 1):
            _check_partition(n_layer, pp, partition_layers(n_layer, pp))


@pytest.mark.parametrize("n_layer,pp,says", [(2, 3, "parallel.pp = 3 is larger than model.n_layer = 2"),
                                             (4, 5, "parallel.pp = 5 is larger than model.n_layer = 4"),
                                             (1, 2, "parallel.pp = 2 is larger than model.n_layer = 1"),
                                             (4, 0, "parallel.pp = 0: must be a positive integer")])
def test_partition_layers_errors(n_layer, pp, says):
    """partition_layers asks Layout.validate (the one definition of a valid layout): its one-line error."""
    from megalite.parallel.grid import LayoutError
    with pytest.raises(LayoutError) as e:
        partition_layers(n_layer, pp)
    assert str(e.value).startswith(says) and "\n" not in str(e.value), str(e.value)


def test_num_warmup_microbatches():
    assert [num_warmup_microbatches(4, s, 8) for s in range(4)] == [3, 2, 1, 0]
    assert [num_warmup_microbatches(2, s, 8) for s in range(2)] == [1, 0]
    assert [num_warmup_microbatches(4, s, 2) for s in range(4)] == [2, 2, 1, 0]  # capped by micro-batches
    assert num_warmup_microbatches(1, 0, 5) == 0
    assert num_warmup_microbatches(8, 0, 1) == 1


def test_shard_range():
    assert [shard_range(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [shard_range(250, r, 4) for r in range(4)] == [(0, 63), (63, 126), (126, 189), (189, 250)]
    assert [shard_range(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [shard_range(5, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]  # an empty last chunk
    assert shard_range(7, 0, 1) == (0, 7)
    for n in range(0, 40):
        for size in range(1, 9):
            ranges = [shard_range(n, r, size) for r in range(size)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert all(0 <= e - s <= -(-n // size) for s, e in ranges)


def test_local_shape_and_tp_box_with_vocab_padding():
    wte = Partition((250, 32), dim=0)
    assert local_shape(wte, 4) == (63, 32)
    assert local_shape(wte, 1) == (250, 32)
    assert [list(tp_box(wte, r, 4)) for r in range(4)] == [[(0, 63), (0, 32)], [(63, 126), (0, 32)],
                                                      [(126, 189), (0, 32)], [(189, 250), (0, 32)]]
    qkv = Partition((3, 64, 32), dim=1)
    assert local_shape(qkv, 2) == (3, 32, 32)
    assert list(tp_box(qkv, 1, 2)) == [(0, 3), (32, 64), (0, 32)]
    row = Partition((32, 128), dim=1)
    assert local_shape(row, 4) == (32, 32)
    assert list(tp_box(row, 2, 4)) == [(0, 32), (64, 96)]
    rep = Partition((32,), dim=None)
    assert local_shape(rep, 4) == (32,)
    assert list(tp_box(rep, 3, 4)) == [(0, 32)]


def test_layout_validate_is_the_one_rule():
    from megalite.parallel.grid import LayoutError
    m = {"n_head": 4, "n_layer": 2}
    assert Layout(2, 2, 3).validate(m) == Layout(2, 2, 3)
    for lay, prefix, msg in [(Layout(0, 1, 1), "parallel.", "parallel.tp = 0: must be a positive integer"),
                             (Layout(1, 1, -2), "--", "--dp -2: must be a positive integer"),
                             (Layout(1, True, 1), "layout.", "layout.pp = True: must be a positive integer"),
                             (Layout(3, 1, 1), "--", "--tp 3 does not divide model.n_head = 4"),
                             (Layout(1, 3, 1), "layout.", "layout.pp = 3 is larger than model.n_layer = 2")]:
        with pytest.raises(LayoutError) as e:
            lay.validate(m, prefix)
        assert str(e.value).startswith(msg), str(e.value)
