"""A damaged byte on every read path: `verify` and every loader agree (issue 42, item 2).

A tensor is read from a checkpoint in five ways (checkpoint/read.py), and each row of the matrix damages one
byte that a named read path uses:

    whole          the same layout: a stored slice read whole (read_stored)
    rows           a row range at another tp (a column-parallel weight, the vocab-parallel embedding)
    columns        a column range at another tp (a row-parallel weight: attn.proj, mlp.proj split on dim 1;
                   read run by run, `_read_runs`)
    flat           a flat range under ZeRO-1 (a dp rank's moments of a whole stored tensor), and flat pieces
                   written by a ZeRO-1 or cp layout, read whole or as another box (`_read_same_box`,
                   `_read_span`)
    cp             a checkpoint written at cp=2 loaded at cp=1 (resharded), and a cp=1 one loaded at cp=2

plus whole files damaged: bytes appended, the file truncated, replaced by another checkpoint's file of the same
size, swapped with another rank's. The rule on every row: `verify` reports it (and `megalite verify` exits 1
naming as many problems); the loaders the row names
(those whose read path meets the byte) refuse in one line and write nothing; every other loader either refuses
too or returns exactly the values it returns from the intact checkpoint (so no loader uses a damaged byte).
Planted while writing this file: the CRC check removed from the column-range path (`_read_runs` reading
without `_check_blocks`): the 'columns' rows fail (the tp=2 rank accepts a damaged byte).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import helpers as H
from megalite.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from megalite.checkpoint import manifest as mf
from megalite.checkpoint.stream import read_header
from megalite.checkpoint.tree import resolve
from megalite.checkpoint.verify import verify
from megalite.config import ModelConfig
from megalite.convert import convert, open_source, reshard
from megalite.model import GPTStage
from megalite.parallel.data import ShardedAdamW
from megalite.parallel.grid import Axis, Coord, Layout, ParallelGrid
from test_checkpoint_integrity import MODEL, fill

BLOCK = 256  # checksum blocks small enough that every weight spans several
R = "tp00-pp00-dp00"


def grid_at(tp=1, dp=1, cp=1, t=0, d=0, c=0) -> ParallelGrid:
    """This rank's place in a (tp, 1, dp, cp) layout, without process groups (loading needs none)."""
    lay, one = Layout(tp, 1, dp, cp), Axis(1, 0)
    return ParallelGrid(lay, lay.rank_of(Coord(t, 0, d, c)), Axis(tp, t), one, Axis(dp, d), Axis(tp, t), one,
                        cp=Axis(cp, c), dp_cp=Axis(dp * cp, c + cp * d))


def model_at(grid, zero1=False):
    model = GPTStage(ModelConfig(**MODEL), grid)
    params = sorted(model.global_parameters(), key=lambda x: x[0])
    return model, ShardedAdamW(params, grid.tp, grid.dp_cp, zero1)


def _load(zero1=False, **at):
    def run(step, out):
        grid = grid_at(**at)
        model, opt = model_at(grid, zero1)
        load_checkpoint(step, model, opt, grid, model_config=MODEL)
        return {**{n: p.detach().clone() for n, p in model.named_parameters()},
                **{f"{n}.exp_avg": t.clone() for n, t in opt.exp_avg.items()},
                **{f"{n}.exp_avg_sq": t.clone() for n, t in opt.exp_avg_sq.items()}}
    return run


def _convert(step, out):
    src = open_source(convert(step, out / "m.safetensors", quiet=True))
    return {n: src.read(n).clone() for n in src.specs}


def _reshard(step, out):
    reshard(step, out / "ck", 2, 1, 1, quiet=True)
    return {}  # it reads every byte: it must refuse every damage (checked below), so no values to compare


LOADERS = {"load 1,1,1": _load(), "load tp=2 r0": _load(tp=2, t=0), "load tp=2 r1": _load(tp=2, t=1),
           "load dp=2 zero1 r0": _load(True, dp=2, d=0), "load dp=2 zero1 r1": _load(True, dp=2, d=1),
           "load cp=2 r1": _load(cp=2, c=1), "convert": _convert, "reshard": _reshard}
EVERY_BYTE = {"load 1,1,1", "reshard"}  # these read every tensor and moment: every row's damage is theirs


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """One (1,1,1) checkpoint with optimizer state, the same state at tp=2, at dp=2 with ZeRO-1, at cp=2, and
    another (1,1,1) checkpoint of other values (files of the same sizes, for 'replaced'); each loader's values
    from the intact checkpoints."""
    mp = pytest.MonkeyPatch()
    mp.setattr(mf, "BLOCK_BYTES", BLOCK)
    tmp = tmp_path_factory.mktemp("matrix")
    grid = ParallelGrid.single()
    for name, seed in (("ck", 0), ("other", 1)):
        model, opt = model_at(grid)
        fill(model, opt, seed)
        save_checkpoint(tmp / name, 7, model, opt, grid, config={"model": MODEL}, tokens_seen=700,
                        data_state={"batch_index": 7})
    reshard(tmp / "ck", tmp / "tp2", 2, 1, 1, quiet=True)
    reshard(tmp / "ck", tmp / "zero1", 1, 1, 2, zero1=True, quiet=True)
    reshard(tmp / "ck", tmp / "cp2", 1, 1, 1, cp=2, quiet=True)
    out = {n: resolve(tmp / n) for n in ("ck", "other", "tp2", "zero1", "cp2")}
    OTHER[:] = [out["other"]]
    intact = {}
    for which in ("ck", "tp2", "zero1", "cp2"):
        assert verify(out[which])[1] == []
        for name, fn in LOADERS.items():
            o = tmp / "intact" / which / name.replace(" ", "_").replace("=", "").replace(",", "")
            o.mkdir(parents=True)
            intact[which, name] = fn(out[which], o)
    yield out, intact
    mp.undo()


# ---------------------------------------------------------------- ways to damage one byte or one file
def at(rel: str, key: str, row: int = 0, col: int = 0):
    """Flip one bit of element (row, col) of tensor `key` in file `rel` (a 1-D tensor: element `row`)."""
    def damage(step):
        path = step / rel
        header, start, _ = read_header(path)
        h = header[key]
        shape = h["shape"]
        item = 4 if h["dtype"] == "F32" else 2
        index = row * (shape[1] if len(shape) > 1 else 1) + col
        a, b = h["data_offsets"]
        assert index * item < b - a
        data = bytearray(path.read_bytes())
        data[start + a + index * item + item - 2] ^= 0x10  # a mantissa/exponent bit: the value changes
        path.write_bytes(bytes(data))
    return damage


def appended(rel: str):
    return lambda step: (step / rel).write_bytes((step / rel).read_bytes() + b"\0" * 8)


def truncated(rel: str):
    return lambda step: (step / rel).write_bytes((step / rel).read_bytes()[:-8])


OTHER: list = []  # the other checkpoint's step folder (set by the fixture)


def replaced(rel: str):
    """The file replaced by the other checkpoint's file of the same name (same size and header)."""
    def damage(step):
        other = OTHER[0] / rel
        assert other.stat().st_size == (step / rel).stat().st_size
        shutil.copy(other, step / rel)
    return damage


def swapped(a: str, b: str):
    def damage(step):
        pa, pb = step / a, step / b
        ta, tb = pa.read_bytes(), pb.read_bytes()
        pa.write_bytes(tb)
        pb.write_bytes(ta)
    return damage


TP1 = "tp01-pp00-dp00"
MODEL_F, OPT_F = "model.safetensors", "optimizer.safetensors"
# (case, base checkpoint, damage, loaders whose read path meets the byte: they must refuse)
MATRIX = [
    ("whole: same layout", "ck", at(f"{R}/{MODEL_F}", "blocks.1.mlp.fc.weight", 100, 3), {"load 1,1,1"}),
    ("rows: wte rows 128-255 at tp=2", "ck", at(f"{R}/{MODEL_F}", "wte.weight", 200, 7), {"load tp=2 r1"}),
    ("rows: qkv at tp=2", "ck", at(f"{R}/{MODEL_F}", "blocks.0.attn.qkv.weight", 40, 2), {"load tp=2 r0"}),
    ("columns: attn.proj columns 0-15 at tp=2", "ck", at(f"{R}/{MODEL_F}", "blocks.0.attn.proj.weight", 20, 5),
     {"load tp=2 r0"}),
    ("columns: attn.proj columns 16-31 at tp=2", "ck", at(f"{R}/{MODEL_F}", "blocks.2.attn.proj.weight", 3, 30),
     {"load tp=2 r1"}),
    ("columns: mlp.proj columns 64-127 at tp=2", "ck", at(f"{R}/{MODEL_F}", "blocks.3.mlp.proj.weight", 31, 100),
     {"load tp=2 r1"}),
    ("columns: an exp_avg of mlp.proj at tp=2", "ck",
     at(f"{R}/{OPT_F}", "blocks.1.mlp.proj.weight.exp_avg", 9, 10), {"load tp=2 r0"}),
    ("whole column slices of tp=2 loaded at tp=1", "tp2", at(f"{TP1}/{MODEL_F}", "blocks.1.attn.proj.weight", 5, 4),
     {"load 1,1,1", "load tp=2 r1"}),
    ("flat: moments ZeRO-1 dp rank 1 keeps", "ck", at(f"{R}/{OPT_F}", "wte.weight.exp_avg", 250, 1),
     {"load dp=2 zero1 r1"}),
    ("flat: moments ZeRO-1 dp rank 0 keeps", "ck", at(f"{R}/{OPT_F}", "blocks.0.attn.qkv.weight.exp_avg_sq", 2, 2),
     {"load dp=2 zero1 r0"}),
    ("flat pieces of a ZeRO-1 checkpoint, same layout", "zero1",
     at("tp00-pp00-dp01/optimizer.safetensors", "blocks.2.mlp.fc.bias.exp_avg", 90), {"load dp=2 zero1 r1"}),
    ("flat pieces of a ZeRO-1 checkpoint read as a tp=2 box", "zero1",
     at("tp00-pp00-dp01/model.safetensors", "blocks.2.mlp.fc.bias", 90), {"load 1,1,1", "load tp=2 r1"}),
    ("cp: a cp=2 checkpoint's slice loaded at cp=1", "cp2",
     at("tp00-cp01-pp00-dp00/model.safetensors", "wte.weight", 17, 3), {"load 1,1,1", "load cp=2 r1"}),
    ("cp: a cp=2 checkpoint's flat piece loaded at cp=1", "cp2",
     at("tp00-cp01-pp00-dp00/model.safetensors", "blocks.2.mlp.fc.bias", 60), {"load 1,1,1", "load cp=2 r1"}),
    ("cp: a cp=1 checkpoint loaded at cp=2", "ck", at(f"{R}/{MODEL_F}", "wpe", 9, 9), {"load cp=2 r1"}),
    ("bytes appended to a model shard", "ck", appended(f"{R}/{MODEL_F}"), set(LOADERS)),
    ("bytes appended to an optimizer shard", "ck", appended(f"{R}/{OPT_F}"), set(LOADERS) - {"convert"}),
    ("bytes appended to a tp=2 shard", "tp2", appended(f"{TP1}/{MODEL_F}"), set(LOADERS) - {"load tp=2 r0"}),
    ("a model shard truncated", "ck", truncated(f"{R}/{MODEL_F}"), set(LOADERS)),
    ("an optimizer shard truncated", "zero1", truncated("tp00-pp00-dp00/optimizer.safetensors"),
     {"load 1,1,1", "load dp=2 zero1 r0", "reshard"}),
    ("a model shard replaced by another step's", "ck", replaced(f"{R}/{MODEL_F}"), set(LOADERS)),
    ("an optimizer shard replaced by another step's", "ck", replaced(f"{R}/{OPT_F}"), set(LOADERS) - {"convert"}),
    ("two ranks' model shards swapped", "tp2", swapped(f"{R}/{MODEL_F}", f"{TP1}/{MODEL_F}"), set(LOADERS)),
]


@pytest.mark.parametrize("case,which,damage,must_refuse", MATRIX, ids=[c[0] for c in MATRIX])
def test_verify_and_every_loader_agree_on_a_damaged_byte(bases, tmp_path, case, which, damage, must_refuse):
    paths, intact = bases
    step = tmp_path / "src" / paths[which].name
    shutil.copytree(paths[which], step)
    (step.parent / "latest").write_text(step.name + "\n")
    damage(step)
    _, problems = verify(step)
    assert problems and all("\n" not in p for p in problems), f"{case}: verify calls it intact"
    rc, out, err = H.cli_in_process("verify", step)  # the command a user runs: exit 1, one line per problem
    assert rc == 1 and err.strip().splitlines()[-1] == f"verify: {len(problems)} problem(s) in {step}", (rc, err)
    refused = {}
    for name, fn in LOADERS.items():
        o = tmp_path / "out" / name.replace(" ", "_").replace("=", "").replace(",", "")
        o.mkdir(parents=True)
        try:
            got = fn(step, o)
        except CheckpointError as e:
            assert "\n" not in str(e) and list(o.iterdir()) == [], f"{case}: {name}: {e}"
            refused[name] = str(e)
            continue
        want = intact[which, name]
        assert name not in EVERY_BYTE | must_refuse, f"{case}: {name} accepted a damaged checkpoint"
        bad = [k for k in want if not torch.equal(got[k], want[k])]
        assert not bad, f"{case}: {name} accepted and loaded damaged values into {bad[:3]}"
    want = EVERY_BYTE | must_refuse
    assert want <= set(refused), f"{case}: refused by {sorted(refused)}, expected {sorted(want)}"
