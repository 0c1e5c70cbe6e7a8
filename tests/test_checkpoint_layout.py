"""The checkpoint tree and the manifest maths, with no training and no processes: names and their inverses,
resolve(), the `latest` pointer, who writes each tensor, tiling checks, and pruning."""
import itertools
import math
import os
import random

import pytest
import torch

from megalite.checkpoint import tree as L
from megalite.checkpoint import manifest as mf
from megalite.checkpoint.tree import CheckpointError
from megalite.checkpoint.tree import prune
from megalite.checkpoint.plan import plan_writes
from megalite.parallel.partition import Box
from megalite.parallel.grid import Coord


# ---------------------------------------------------------------- names and their inverses
@pytest.mark.parametrize("c", [Coord(0, 0, 0), Coord(1, 0, 3), Coord(7, 15, 2), Coord(12, 3, 99), Coord(100, 0, 123)])
def test_coord_dir_round_trip(c):
    name = L.coord_dir(c)
    assert name.startswith("tp") and "-pp" in name and "-dp" in name
    assert L.parse_coord_dir(name) == c


def test_coord_dir_format_and_bad_names():
    assert L.coord_dir(Coord(1, 2, 3)) == "tp01-pp02-dp03"
    for bad in ("tp1-pp02-dp03", "tp01-pp02", "step_00000001", "tp01-pp02-dp03/x", "TP01-PP02-DP03", ""):
        with pytest.raises(ValueError):
            L.parse_coord_dir(bad)


@pytest.mark.parametrize("step", [0, 1, 200, 99_999_999, 123_456_789])
def test_step_dir_round_trip(step):
    assert L.parse_step_dir(L.step_dir(step)) == step


def test_step_dir_rejects_other_names():
    assert L.step_dir(200) == "step_00000200"
    for bad in ("step_1", "step_0000001x", "latest", "manifest.json", "tp00-pp00-dp00", L.tmp_dir(5),
                ".tmp-old-step_00000005"):
        assert L.parse_step_dir(bad) is None, bad
    assert L.tmp_dir(5).startswith(L.TMP_PREFIX)


def _committed(root, step, manifest=True):
    d = root / L.step_dir(step)
    d.mkdir(parents=True)
    if manifest:
        (d / L.MANIFEST).write_text("{}")
    return d


def test_committed_steps_only_counts_folders_with_a_manifest(tmp_path):
    for s in (3, 1, 12):
        _committed(tmp_path, s)
    _committed(tmp_path, 7, manifest=False)  # a half-written folder
    (tmp_path / L.tmp_dir(20)).mkdir()
    (tmp_path / L.tmp_dir(20) / L.MANIFEST).write_text("{}")  # a commit in progress is not committed
    (tmp_path / "step_00000030").write_text("a file, not a folder")
    assert L.committed_steps(tmp_path) == [1, 3, 12]
    assert L.committed_steps(tmp_path / "missing") == []


# ---------------------------------------------------------------- resolve and latest
def test_resolve_root_and_step_dir(tmp_path):
    s2, s4 = _committed(tmp_path, 2), _committed(tmp_path, 4)
    L.write_latest(tmp_path, s2.name)
    assert L.resolve(tmp_path) == s2  # the root means the step `latest` names, not the newest folder
    assert L.resolve(str(s4)) == s4  # a step folder means itself
    L.write_latest(tmp_path, s4.name)
    assert L.resolve(tmp_path) == s4


def test_resolve_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        L.resolve(tmp_path / "nope")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointError) as e:
        L.resolve(tmp_path / "plain")
    assert "plain" in str(e.value) and "\n" not in str(e.value)
    root = tmp_path / "root"
    _committed(root, 1)
    L.write_latest(root, "step_00000009")  # names a missing folder
    with pytest.raises(CheckpointError) as e:
        L.resolve(root)
    assert "step_00000009" in str(e.value) and "\n" not in str(e.value)
    _committed(root, 9, manifest=False)  # present, but never committed
    with pytest.raises(CheckpointError, match="step_00000009"):
        L.resolve(root)
    with pytest.raises(CheckpointError):  # a step folder without a manifest is not a checkpoint either
        L.resolve(root / "step_00000009")


def test_write_latest_content_and_replace(tmp_path):
    L.write_latest(tmp_path, "step_00000002")
    assert (tmp_path / L.LATEST).read_text() == "step_00000002\n"
    assert L.read_latest(tmp_path) == "step_00000002"
    ino = os.stat(tmp_path / L.LATEST).st_ino
    L.write_latest(tmp_path, "step_00000004")
    assert L.read_latest(tmp_path) == "step_00000004"
    assert os.stat(tmp_path / L.LATEST).st_ino != ino  # a new file renamed over, not rewritten in place
    assert sorted(p.name for p in tmp_path.iterdir()) == [L.LATEST]  # no temporary left behind
    assert L.read_latest(tmp_path / "elsewhere") is None


def test_write_latest_is_atomic_when_the_rename_fails(tmp_path, monkeypatch):
    L.write_latest(tmp_path, "step_00000002")

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(L.os, "replace", boom)
    with pytest.raises(OSError):
        L.write_latest(tmp_path, "step_00000004")
    monkeypatch.undo()
    assert (tmp_path / L.LATEST).read_text() == "step_00000002\n"  # old pointer intact, never half-written


# ---------------------------------------------------------------- who writes what: one flat space cut over dp
def test_dp_pieces_by_hand():
    from megalite.parallel.data import dp_pieces
    tensors = [("c", 4, False), ("a", 5, False), ("t", 10, True), ("b", 3, False)]  # space a|b|c = 12, t apart
    got = [dp_pieces(tensors, r, 3) for r in range(3)]
    assert got[0] == {"a": (0, 4), "b": (0, 0), "c": (0, 0), "t": (0, 4)}
    assert got[1] == {"a": (4, 5), "b": (0, 3), "c": (0, 0), "t": (4, 8)}
    assert got[2] == {"a": (0, 0), "b": (0, 0), "c": (0, 4), "t": (8, 10)}
    assert dp_pieces(reversed(tensors), 1, 3) == got[1]  # a pure function of the set: no rank can disagree


@pytest.mark.parametrize("dp", [1, 2, 3, 8, 64])
def test_dp_pieces_tile_every_tensor_and_balance_the_ranks(dp):
    from megalite.parallel.data import dp_pieces
    from megalite.parallel.partition import shard_range
    rng = random.Random(dp)
    tensors = [(f"t{i}", rng.randint(1, 5_000), i % 17 == 0) for i in range(120)]
    pieces = [dp_pieces(tensors, r, dp) for r in range(dp)]
    size, tied = {n: k for n, k, _ in tensors}, {n: t for n, _, t in tensors}
    own_total = sum(k for n, k in size.items() if not tied[n])
    for r, got in enumerate(pieces):
        held = [(n, a, b) for n, (a, b) in got.items() if a < b and not tied[n]]
        lo, hi = shard_range(own_total, r, dp)
        assert sum(b - a for _, a, b in held) == hi - lo  # every rank holds ceil(total / dp) (the last less)
        assert sum((a, b) != (0, size[n]) for n, a, b in held) <= 2  # whole tensors but the range's two ends
    for name, k, tied in tensors:
        ranges = sorted(p[name] for p in pieces if p[name][0] < p[name][1])
        assert ranges[0][0] == 0 and ranges[-1][1] == k and all(x[1] == y[0] for x, y in zip(ranges, ranges[1:]))
    slices = sum(1 for p in pieces for a, b in p.values() if a < b)
    assert slices <= len(tensors) + (dp - 1) * (1 + sum(t for _, _, t in tensors))  # ~dp more, not dp x tensors


# ---------------------------------------------------------------- tiling
def _entry(shape, *slices):
    return {"shape": list(shape), "slices": [dict(file=f"f{i}", key="k", box=[list(r) for r in s[0]],
                                                  **({"flat": list(s[1])} if len(s) > 1 else {}))
                                             for i, s in enumerate(slices)]}


def test_tiling_exact_is_fine():
    assert mf.tiling_problems("w", _entry([8, 4], ([[0, 8], [0, 4]],))) == []
    assert mf.tiling_problems("w", _entry([8, 4], ([[0, 4], [0, 4]],), ([[4, 8], [0, 4]],))) == []
    assert mf.tiling_problems("w", _entry([8, 4], ([[0, 8], [2, 4]],), ([[0, 8], [0, 2]],))) == []
    assert mf.tiling_problems("b", _entry([5], ([[0, 3]],), ([[3, 5]],))) == []


def test_tiling_gap():
    probs = mf.tiling_problems("w", _entry([8, 4], ([[0, 4], [0, 4]],), ([[5, 8], [0, 4]],)))
    assert probs and all("'w'" in p for p in probs)
    assert any("hole" in p for p in probs)
    assert mf.tiling_problems("w", _entry([8, 4])) != []  # nothing stored at all


def test_tiling_overlap():
    probs = mf.tiling_problems("w", _entry([8, 4], ([[0, 5], [0, 4]],), ([[4, 8], [0, 4]],)))
    assert any("overlap" in p for p in probs), probs
    probs = mf.tiling_problems("w", _entry([8, 4], ([[0, 8], [0, 4]],), ([[0, 8], [0, 4]],)))
    assert probs, "the same box stored twice must be reported"


def test_tiling_proof_accepts_only_what_the_grid_count_accepts(monkeypatch):
    """The cheap proof tried first (tiling._exact_cover: no two boxes overlap and their sizes add up to the
    shape's) never accepts what the grid count refuses, and accepts every real tiling (so loads use it).
    Random tilings of small 2-d and 3-d shapes, some with one box shifted by one (same size: an overlap on one
    side, a hole on the other, which a size check alone would pass) or grown or shrunk."""
    from megalite.checkpoint import tiling
    rng = random.Random(30)
    proved = 0
    for _ in range(3000):
        shape = [rng.randint(1, 6) for _ in range(rng.choice((2, 3)))]
        cuts = [sorted({0, n, *rng.sample(range(1, n), min(n - 1, rng.randint(0, 2)))}) if n > 1 else [0, 1]
                for n in shape]
        boxes = [[list(r) for r in cell] for cell in itertools.product(*[list(zip(c, c[1:])) for c in cuts])]
        tiled = rng.random() < 0.5
        if not tiled:
            b, d = rng.randrange(len(boxes)), rng.randrange(len(shape))
            a, e = boxes[b][d]
            move = rng.choice(((1, 1), (-1, -1), (0, 1), (0, -1), (-1, 0)))
            boxes[b][d] = [a + move[0], e + move[1]]
            if not 0 <= boxes[b][d][0] < boxes[b][d][1] <= shape[d]:
                continue
        entry = _entry(shape, *[(b,) for b in boxes])
        fast = tiling._exact_cover({Box(map(tuple, b)): [None] for b in boxes}, shape)
        monkeypatch.setattr(tiling, "DISJOINT_PAIRS", 0)  # the grid count alone
        slow = mf.tiling_problems("w", entry)
        monkeypatch.undo()
        assert not (fast and slow), (shape, boxes, slow)
        assert fast == (slow == []), (shape, boxes, slow)
        assert mf.tiling_problems("w", entry) == slow  # with the proof first: the same verdict and words
        proved += fast
    assert proved > 1000


def test_tiling_out_of_bounds():
    assert mf.tiling_problems("w", _entry([8, 4], ([[0, 9], [0, 4]],)))
    assert mf.tiling_problems("w", _entry([8, 4], ([[0, 8]],)))  # wrong rank


def test_tiling_zero1_flat_pieces():
    box = [[0, 8], [0, 4]]  # 32 elements
    ok = _entry([8, 4], (box, [0, 11]), (box, [11, 22]), (box, [22, 32]))
    assert mf.tiling_problems("m", ok) == []
    gap = _entry([8, 4], (box, [0, 11]), (box, [12, 22]), (box, [22, 32]))
    assert any("hole" in p for p in mf.tiling_problems("m", gap))
    overlap = _entry([8, 4], (box, [0, 12]), (box, [11, 22]), (box, [22, 32]))
    assert any("overlap" in p for p in mf.tiling_problems("m", overlap))
    short = _entry([8, 4], (box, [0, 11]), (box, [11, 22]))
    assert mf.tiling_problems("m", short)
    long = _entry([8, 4], (box, [0, 11]), (box, [11, 33]))
    assert mf.tiling_problems("m", long)
    # tp slices each split into ZeRO pieces (tp=2, dp=2)
    b0, b1 = [[0, 4], [0, 4]], [[4, 8], [0, 4]]
    assert mf.tiling_problems("m", _entry([8, 4], (b0, [0, 8]), (b0, [8, 16]), (b1, [0, 8]), (b1, [8, 16]))) == []
    assert mf.tiling_problems("m", _entry([8, 4], (b0, [0, 8]), (b0, [8, 16]), (b1, [0, 8])))


# ---------------------------------------------------------------- pruning
def test_prune_keeps_the_last_n(tmp_path):
    for s in range(1, 6):
        _committed(tmp_path, s)
    L.write_latest(tmp_path, L.step_dir(5))
    assert sorted(prune(tmp_path, 2)) == [1, 2, 3]
    assert L.committed_steps(tmp_path) == [4, 5]
    assert prune(tmp_path, 0) == [] and L.committed_steps(tmp_path) == [4, 5]  # 0 = keep everything
    assert sorted(prune(tmp_path, 1)) == [4]
    assert L.committed_steps(tmp_path) == [5]
    assert L.resolve(tmp_path).name == L.step_dir(5)


def test_prune_never_deletes_what_latest_names_or_anything_newer(tmp_path):
    for s in range(1, 7):
        _committed(tmp_path, s)
    L.write_latest(tmp_path, L.step_dir(2))  # a run rolled back to step 2: steps 3-6 are another history's
    assert L.committed_steps(tmp_path) == [3, 4, 5, 6, 1, 2]  # oldest first: the abandoned ones
    assert prune(tmp_path, 2) == [] and sorted(L.committed_steps(tmp_path)) == [1, 2, 3, 4, 5, 6]
    assert L.resolve(tmp_path).name == L.step_dir(2)
    assert prune(tmp_path, 1) == [1]  # only steps up to the one saved (here: the one `latest` names) count
    assert sorted(L.committed_steps(tmp_path)) == [2, 3, 4, 5, 6]
    L.write_latest(tmp_path, L.step_dir(6))
    assert prune(tmp_path, 1, saved=6, keep={3, 5}) == [2, 4]  # `keep`: failed verification / not this run's
    assert sorted(L.committed_steps(tmp_path)) == [3, 5, 6]


# ---------------------------------------------------------------- the write plan of a whole grid
def _stage_tensors(stage: int, pp: int):
    from megalite.parallel.partition import Partition as P
    first = [("wte.weight", P((257, 32), 0)), ("wpe", P((16, 32), None))]  # 257 rows: a short last tp slice
    layers = []
    for i in range(2):
        layers += [(f"blocks.{i}.attn.qkv.weight", P((96, 32), 0)), (f"blocks.{i}.attn.proj.weight", P((32, 32), 1)),
                   (f"blocks.{i}.attn.proj.bias", P((32,), None)), (f"blocks.{i}.ln_1.weight", P((32,), None)),
                   (f"blocks.{i}.mlp.fc.bias", P((128,), 0)), (f"blocks.{i}.tiny", P((1,), None))]
    last = [("ln_f.weight", P((32,), None)), ("lm_head", P((257, 32), 0, tied_to="wte.weight"))]
    if pp == 1:
        return first + layers + last
    half = len(layers) // 2
    return first + layers[:half] if stage == 0 else layers[half:] + last


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (2, 1, 1), (1, 1, 2), (2, 2, 2), (4, 1, 2), (1, 2, 4), (2, 1, 3),
                                      (2, 2, 16)])
def test_plan_writes_of_all_coordinates_tile_every_tensor_once(tp, pp, dp):
    from megalite.parallel.grid import Layout
    lay = Layout(tp, pp, dp)
    sections = {"model": {}, "optimizer_state": {}}
    written = {c: 0 for c in lay.coords()}
    for c in lay.coords():
        tensors = _stage_tensors(c.pp, pp)
        items = plan_writes(tensors, c, lay)
        assert items == plan_writes(list(reversed(tensors)), c, lay)  # order-independent
        shapes = dict(tensors)
        for it in items:
            assert not shapes[it.name].tied_to, "a tied copy must never be written"
            assert dp > 1 or it.flat is None
            section = sections["model" if it.kind == "model" else "optimizer_state"]
            entry = section.setdefault(it.key, {"shape": list(shapes[it.name].global_shape), "slices": []})
            sl = {"file": f"{L.coord_dir(c)}/{it.file}", "key": it.key, "box": [list(r) for r in it.box]}
            if it.flat is not None:
                sl["flat"] = list(it.flat)
            entry["slices"].append(sl)
            if it.kind == "model":
                written[c] += it.flat[1] - it.flat[0] if it.flat else it.box.numel
    expected = {n for s in range(pp) for n, p in _stage_tensors(s, pp) if not p.tied_to}
    assert set(sections["model"]) == expected
    assert set(sections["optimizer_state"]) == {f"{n}.{m}" for n in expected for m in ("exp_avg", "exp_avg_sq")}
    for section in sections.values():
        for name, entry in section.items():
            assert mf.tiling_problems(name, entry) == [], (name, entry["slices"])
            keys = [(s["file"], s["key"]) for s in entry["slices"]]
            assert len(keys) == len(set(keys))
    # no model element is written twice (not by two dp replicas, not by two tp ranks): one model in total
    assert sum(written.values()) == sum(math.prod(p.global_shape) for n, p in
                                        (t for s in range(pp) for t in _stage_tensors(s, pp)) if not p.tied_to)


# ---------------------------------------------------------------- Box
def test_box_arithmetic():
    b = Box([[2, 6], [0, 4]])
    assert b == ((2, 6), (0, 4)) and b.shape == (4, 4) and b.numel == 16 and b.to_json() == [[2, 6], [0, 4]]
    assert Box.whole([8, 4]).intersect(b) == b
    assert b.intersect(Box([[6, 8], [0, 4]])) is None  # touching is not overlapping
    inter = b.intersect(Box([[4, 8], [1, 3]]))
    assert inter == ((4, 6), (1, 3))
    full = torch.arange(32).view(8, 4)
    assert torch.equal(full[b.index][inter.within(b)], full[inter.index])
