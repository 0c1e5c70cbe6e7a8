"""Bad input, through the real CLI in a subprocess: every mistake exits 2 (verify: 1, it reports problems)
with exactly one line on stderr naming the field or path and what was expected, never a traceback, and
without writing anything: no out_dir, no --out, no checkpoint folder, the inputs untouched."""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers import cli, one_line_error


@pytest.fixture(scope="module")
def world(inputs_world):
    """The session's read-only inputs (conftest.inputs_world): trained once, shared with test_error_contract."""
    return inputs_world


def _snapshot(root: Path) -> dict:
    """Every path under root with its size and modification time (and the file's bytes when small)."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (p.is_dir(), st.st_size, st.st_mtime_ns,
                                         p.read_bytes() if p.is_file() and st.st_size < 4096 else None)
    return out


TRAIN = ["train", "--config", "{toml}", "--train.out_dir={tmp}/run", "--checkpoint.dir={tmp}/ck"]

# id, argv (formatted with the world's paths and {tmp}, the case's own folder), exit code, fragments that
# the one stderr line must contain, files the case creates first ({name: text})
CASES = [
    ("unknown-section", [*TRAIN, "--modle.n_layer=2"], 2, ["unknown section", "'modle'"], {}),
    ("unknown-key", [*TRAIN, "--model.n_layers=2"], 2, ["unknown key", "'model.n_layers'", "n_layer"], {}),
    ("wrong-type-flag", [*TRAIN, "--model.n_layer=two"], 2, ["model.n_layer", "'two'", "int"], {}),
    ("wrong-type-toml", ["train", "--config", "{tmp}/bad.toml"], 2, ["bad.toml", "model.n_layer", "str", "int"],
     {"bad.toml": '[model]\nn_layer = "4"\n'}),
    ("n_layer-zero", [*TRAIN, "--model.n_layer=0"], 2, ["model.n_layer = 0", "positive"], {}),
    ("steps-negative", [*TRAIN, "--train.steps=-1"], 2, ["train.steps = -1", "positive"], {}),
    ("micro-batch-zero", [*TRAIN, "--train.micro_batch_size=0"], 2, ["train.micro_batch_size = 0", "positive"],
     {}),
    ("tp-does-not-divide-heads", [*TRAIN, "--parallel.tp=3"], 2, ["parallel.tp = 3", "model.n_head = 4"], {}),
    ("pp-larger-than-layers", [*TRAIN, "--parallel.pp=3"], 2, ["parallel.pp = 3", "model.n_layer = 2"], {}),
    ("world-size", [*TRAIN, "--parallel.tp=2"], 2, ["world size 1", "tp*pp*dp", "2"], {}),
    ("batch-does-not-divide", [*TRAIN, "--train.micro_batch_size=3"], 2,
     ["train.global_batch_size = 8", "train.micro_batch_size", "parallel.dp"], {}),
    ("missing-data", [*TRAIN, "--data.path={tmp}/nope.bin", "--data.auto_prepare=false"], 2,
     ["data.path", "nope.bin", "does not exist"], {}),
    ("block-larger-than-data", [*TRAIN, "--data.path={small}", "--model.block_size=64"], 2,
     ["model.block_size", "64", "65 tokens", "has 40"], {}),
    ("missing-config", ["train", "--config", "{tmp}/nope.toml"], 2, ["--config", "nope.toml", "does not exist"],
     {}),
    ("train-unknown-flag", [*TRAIN, "--frobnicate"], 2, ["--frobnicate", "--section.key=value"], {}),
    ("out-dir-under-a-file", ["train", "--config", "{toml}", "--train.out_dir={tmp}/a-file/run"], 2,
     ["train.out_dir", "a-file"], {"a-file": "not a folder"}),
    ("unknown-subcommand", ["frobnicate"], 2, ["invalid choice", "'frobnicate'"], {}),
    ("convert-unknown-flag", ["convert", "{ckpt}", "--out", "x.safetensors", "--frobnicate"], 2,
     ["unrecognized arguments", "--frobnicate"], {}),
    ("convert-missing-out", ["convert", "{ckpt}"], 2, ["--out", "required"], {}),
    ("split-tp3", ["split", "{model}", "--tp", "3", "--pp", "1", "--dp", "1", "--out", "{tmp}/ck3"], 2,
     ["--tp 3", "does not divide", "model.n_head = 4"], {}),
    ("reshard-pp3", ["reshard", "{ckpt}", "--tp", "1", "--pp", "3", "--dp", "1", "--out", "{tmp}/ck3"], 2,
     ["--pp 3", "larger than", "model.n_layer = 2"], {}),
    ("convert-out-exists", ["convert", "{ckpt}", "--out", "{tmp}/m.safetensors"], 2,
     ["m.safetensors", "already exists", "--force"], {"m.safetensors": "keep me"}),
    ("convert-empty-folder", ["convert", "{empty}", "--out", "{tmp}/m.safetensors"], 2,
     ["{empty}", "not a checkpoint"], {}),
    ("convert-random-file", ["convert", "{random}", "--out", "{tmp}/m.safetensors"], 2,
     ["{random}", "not a checkpoint"], {}),
    ("convert-missing-path", ["convert", "{tmp}/nothing", "--out", "{tmp}/m.safetensors"], 2,
     ["nothing", "does not exist"], {}),
    ("inspect-empty-folder", ["inspect", "{empty}"], 2, ["{empty}", "not a checkpoint"], {}),
    ("inspect-random-file", ["inspect", "{random}", "--tree"], 2, ["{random}", "not a checkpoint"], {}),
    ("verify-empty-folder", ["verify", "{empty}"], 1, ["verify:", "problem", "{empty}"], {}),
    ("verify-random-file", ["verify", "{random}"], 1, ["verify:", "problem", "{random}"], {}),
    ("split-random-file", ["split", "{random}", "--tp", "1", "--pp", "1", "--dp", "1", "--out", "{tmp}/ck1"], 2,
     ["{random}", "not a readable safetensors file"], {}),
    ("unknown-format", ["convert", "{ckpt}", "--out", "{tmp}/m", "--format", "onnx"], 2,
     ["--format 'onnx'", "megalite, hf-gpt2"], {}),
]


KNOWN_BUGS: dict = {}


@pytest.mark.parametrize("name,argv,code,fragments,files", [
    pytest.param(*c, id=c[0], marks=[pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[c[0]])] if c[0] in KNOWN_BUGS
                 else []) for c in CASES])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, world, name, argv, code, fragments, files):
    case = tmp_path / "case"
    case.mkdir()
    for fname, text in files.items():
        (case / fname).write_text(text)
    paths = {k: str(v) for k, v in world.items()} | {"tmp": str(case)}
    args = [a.format(**paths) for a in argv]
    before, world_before = _snapshot(case), _snapshot(world["dir"])
    p = cli(*args, cwd=case)
    shown = f"megalite {' '.join(args)}\nexit {p.returncode}\n--- stdout\n{p.stdout[-2000:]}\n--- stderr\n" \
            f"{p.stderr[-3000:]}"
    line = one_line_error(p, ("megalite", "verify:"), code=code)
    for fragment in fragments:
        assert fragment.format(**paths) in line, (fragment, line)
    if code == 1:  # verify reports the problem on stdout, one line naming the path
        assert len(p.stdout.splitlines()) == 1 and paths[argv[1][1:-1]] in p.stdout, shown
    else:
        assert p.stdout == "", shown
    assert _snapshot(case) == before, "the command wrote something"
    assert _snapshot(world["dir"]) == world_before, "the command touched its inputs"
