"""Converter errors: one line naming what is wrong, CLI exit 2 without a traceback, and nothing written
(no output, no temporary leftovers next to --out, the source untouched)."""
from __future__ import annotations

import contextlib
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import helpers as H
from megalite.checkpoint import CheckpointError
from megalite.checkpoint import manifest as mf
from megalite.checkpoint.stream import read_header
from megalite.checkpoint.tree import resolve
from megalite.convert import ConvertError, convert, reshard, split


@pytest.fixture
def ckpt(tmp_path, model_file):
    """A private (2,2,1) checkpoint (split of the trained model) that a test may damage."""
    split(model_file, tmp_path / "src", 2, 2, 1, quiet=True)
    return tmp_path / "src"


@pytest.fixture
def outdir(tmp_path):
    d = tmp_path / "out"
    d.mkdir()
    return d


def assert_nothing_written(outdir) -> None:
    assert sorted(p.name for p in outdir.iterdir()) == [], "something was left next to --out"


@contextlib.contextmanager
def refused(outdir, error, pattern: str):
    """The block raises `error` matching `pattern`, and leaves nothing next to --out."""
    with pytest.raises(error, match=pattern):
        yield
    assert_nothing_written(outdir)


def resave(src, dst, edit) -> None:
    """Load a safetensors file, apply edit(tensors) and save the result to dst with the same metadata."""
    tensors = load_file(str(src))
    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata()
    edit(tensors)
    save_file(tensors, str(dst), metadata=meta)


def a_slice(step, name: str) -> dict:
    return mf.read_json(step)["model"][name]["slices"][-1]


def edit_shard(ckpt, name: str, edit) -> str:
    """Apply edit(tensors, key) to the shard file that holds the last slice of tensor `name` and fix the
    file's size and checksum in the manifest (so only the content is wrong); return the file's path in the step."""
    step = resolve(ckpt)
    sl = a_slice(step, name)
    path = step / sl["file"]
    resave(path, path, lambda tensors: edit(tensors, sl["key"]))
    man = mf.read_json(step)
    man["files"][sl["file"]] = {"bytes": path.stat().st_size, "header_crc32c": f"{read_header(path)[2]:08x}"}
    mf.write_json(step, mf.sign(man))
    return sl["file"]


# ---------------------------------------------------------------- layouts
@pytest.mark.parametrize("tp,pp,dp,pattern", [
    (3, 1, 1, r"--tp 3 does not divide model\.n_head = 4"),
    (1, 5, 1, r"--pp 5 is larger than model\.n_layer = 4"),
    (0, 1, 1, r"--tp 0: must be a positive integer"),
    (1, 1, 0, r"--dp 0: must be a positive integer"),
])
def test_layout_that_does_not_fit_the_model(tmp_path, outdir, run111, model_file, tp, pp, dp, pattern):
    with pytest.raises(ConvertError, match=pattern):
        split(model_file, outdir / "ck", tp, pp, dp)
    with pytest.raises(ConvertError, match=pattern):
        reshard(run111["ckpt"], outdir / "ck", tp, pp, dp)
    assert_nothing_written(outdir)


def test_layout_errors_via_cli(outdir, run111, model_file):
    r = H.cli("split", model_file, "--tp", 3, "--pp", 1, "--dp", 1, "--out", outdir / "ck")
    H.one_line_error(r, "megalite split: error: ", match=r"--tp 3 does not divide model\.n_head = 4")
    r = H.cli("reshard", run111["ckpt"], "--tp", 1, "--pp", 5, "--dp", 1, "--out", outdir / "ck")
    H.one_line_error(r, "megalite reshard: error: ", match=r"--pp 5 is larger than model\.n_layer = 4")
    assert_nothing_written(outdir)


# ---------------------------------------------------------------- damaged checkpoints
def test_tensor_missing_from_the_manifest(ckpt, outdir):
    step = resolve(ckpt)
    man = mf.read_json(step)
    del man["model"]["blocks.2.mlp.fc.weight"]
    mf.write_json(step, mf.sign(man))
    with refused(outdir, CheckpointError, r"blocks\.2\.mlp\.fc\.weight.*missing"):
        convert(ckpt, outdir / "m.safetensors")
    with refused(outdir, CheckpointError, r"blocks\.2\.mlp\.fc\.weight.*missing"):
        reshard(ckpt, outdir / "ck", 1, 1, 1)


def test_tensor_missing_from_a_shard(ckpt, outdir):
    name = "ln_f.weight"  # on the last stage: converting has written earlier tensors when it fails
    rel = edit_shard(ckpt, name, lambda tensors, key: tensors.pop(key))
    with refused(outdir, CheckpointError, rf"'{name}'.*missing from {rel}"):
        convert(ckpt, outdir / "m.safetensors")
    with refused(outdir, CheckpointError, rf"'{name}'.*missing from {rel}"):
        convert(ckpt, outdir / "hf", fmt="hf-gpt2")
    r = H.cli("convert", ckpt, "--out", outdir / "m.safetensors")
    H.one_line_error(r, "megalite convert: error: ", match=rf"'{name}'.*missing from {rel}")
    assert_nothing_written(outdir)


def test_shard_shape_disagrees_with_the_manifest(ckpt, outdir):
    name = "blocks.3.mlp.fc.weight"
    rel = edit_shard(ckpt, name, lambda tensors, key: tensors.update({key: tensors[key][:-1].contiguous()}))
    with refused(outdir, CheckpointError, rf"'{name}' in {rel} has shape .*the manifest says"):
        convert(ckpt, outdir / "m.safetensors")
    with refused(outdir, CheckpointError, rf"'{name}' in {rel} has shape"):
        reshard(ckpt, outdir / "ck", 1, 1, 1)


def test_manifest_global_shape_disagrees_with_the_slices(ckpt, outdir):
    step = resolve(ckpt)
    man = mf.read_json(step)
    man["model"]["wpe"]["shape"] = [17, 32]
    mf.write_json(step, mf.sign(man))
    # refused up front: the slices leave a hole (the model config also implies [16, 32])
    with refused(outdir, CheckpointError, r"'wpe'.*(hole|global shape \[17, 32\])"):
        convert(ckpt, outdir / "m.safetensors")


def test_corrupted_shard_fails_its_checksum(ckpt, outdir):
    step = resolve(ckpt)
    sl = a_slice(step, "wte.weight")
    path = step / sl["file"]
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # a payload byte, the header stays readable
    path.write_bytes(bytes(data))
    with refused(outdir, CheckpointError, r"fails its checksum"):
        convert(ckpt, outdir / "m.safetensors")


def test_split_of_a_file_with_a_wrong_shape(tmp_path, outdir, model_file):
    bad = tmp_path / "bad.safetensors"
    name = "blocks.2.mlp.fc.weight"
    resave(model_file, bad, lambda tensors: tensors.update({name: tensors[name][:, :31].contiguous()}))
    with refused(outdir, ConvertError, r"'blocks\.2\.mlp\.fc\.weight' has shape \[128, 31\], expected \[128, 32\]"):
        split(bad, outdir / "ck", 2, 2, 1)


def test_split_of_a_file_missing_a_tensor(tmp_path, outdir, model_file):
    resave(model_file, tmp_path / "bad.safetensors", lambda tensors: tensors.pop("blocks.1.attn.qkv.bias"))
    with refused(outdir, ConvertError, r"'blocks\.1\.attn\.qkv\.bias' is missing"):
        split(tmp_path / "bad.safetensors", outdir / "ck", 1, 1, 1)


def test_split_of_a_file_without_megalite_metadata(tmp_path, outdir, model_file):
    save_file(load_file(str(model_file)), str(tmp_path / "plain.safetensors"))
    with pytest.raises(ConvertError, match=r"no 'megalite\.model_config'"):
        split(tmp_path / "plain.safetensors", outdir / "ck", 1, 1, 1)
    with refused(outdir, ConvertError, r"does not exist"):
        split(tmp_path / "nope.safetensors", outdir / "ck", 1, 1, 1)


def test_not_a_checkpoint(tmp_path, outdir):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"is not a checkpoint"):
        convert(tmp_path / "empty", outdir / "m.safetensors")
    with refused(outdir, CheckpointError, r"does not exist"):
        convert(tmp_path / "missing", outdir / "m.safetensors")


# ---------------------------------------------------------------- flags
def test_unknown_format_and_dtype(run111, outdir):
    with pytest.raises(ConvertError, match=r"--format 'onnx': expected one of megalite, hf, hf-gpt2"):
        convert(run111["ckpt"], outdir / "m", fmt="onnx")
    with pytest.raises(ConvertError, match=r"--dtype 'int8': expected one of fp32, bf16, fp16"):
        convert(run111["ckpt"], outdir / "m", dtype="int8")
    r = H.cli("convert", run111["ckpt"], "--out", outdir / "m", "--format", "onnx")
    H.one_line_error(r, "megalite convert: error: ", match=r"--format 'onnx'")
    assert_nothing_written(outdir)


# ---------------------------------------------------------------- output safety
def test_existing_output_needs_force(tmp_path, outdir, run111, model_file):
    """An existing output is replaced only with --force, and --force replaces only an output of the same kind
    megalite wrote (issue 21: it once replaced a user's file and deleted a folder of other files)."""
    src = run111["ckpt"]
    before = H.tree_digest(src)
    out = outdir / "m.safetensors"
    out.write_bytes(b"keep me")
    with pytest.raises(ConvertError, match=r"already exists \(pass --force"):
        convert(src, out)
    with pytest.raises(ConvertError, match=r"already exists and is not a model file written by"):
        convert(src, out, force=True, quiet=True)
    assert out.read_bytes() == b"keep me"
    out.unlink()
    assert convert(src, out, quiet=True) == out
    assert convert(src, out, force=True, quiet=True) == out  # over its own output: replaced
    assert out.read_bytes() == model_file.read_bytes()
    # a folder output (split / reshard / hf-gpt2) likewise
    ck = outdir / "ck"
    ck.mkdir()
    (ck / "mine.txt").write_text("keep")
    for fn in (lambda force: split(model_file, ck, 2, 1, 1, force=force, quiet=True),
               lambda force: reshard(src, ck, 2, 1, 1, force=force, quiet=True),
               lambda force: convert(src, ck, fmt="hf-gpt2", force=force, quiet=True)):
        with pytest.raises(ConvertError, match=r"already exists"):
            fn(False)
        with pytest.raises(ConvertError, match=r"mine.txt"):
            fn(True)
        assert (ck / "mine.txt").read_text() == "keep"
    (ck / "mine.txt").unlink()
    ck.rmdir()
    reshard(src, ck, 1, 1, 1, quiet=True)
    reshard(src, ck, 2, 1, 1, force=True, quiet=True)
    assert mf.read(resolve(ck)).layout.tp == 2
    assert sorted(p.name for p in outdir.iterdir()) == ["ck", "m.safetensors"]  # no temp or .old leftovers
    assert H.tree_digest(src) == before


def test_existing_output_via_cli(outdir, run111, model_file):
    out = outdir / "m.safetensors"
    out.write_bytes(b"keep me")
    r = H.cli("convert", run111["ckpt"], "--out", out)
    H.one_line_error(r, "megalite convert: error: ", match=r"already exists \(pass --force")
    assert out.read_bytes() == b"keep me"
    r = H.cli("convert", run111["ckpt"], "--out", out, "--force", "--quiet")  # not megalite's: kept
    H.one_line_error(r, "megalite convert: error: ", match=r"not a model file written by `megalite convert`")
    assert out.read_bytes() == b"keep me"
    with safe_open(str(model_file), framework="pt") as f:  # a model file megalite wrote, with other tensors
        meta = f.metadata()
    save_file({"x": torch.zeros(2)}, str(out), metadata=meta)
    r = H.cli("convert", run111["ckpt"], "--out", out, "--force", "--quiet")
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", r.stderr
    assert out.read_bytes() == model_file.read_bytes()
    assert sorted(p.name for p in outdir.iterdir()) == ["m.safetensors"]


def test_out_inside_the_source_is_refused(tmp_path, run111, model_file):
    src = tmp_path / "src"
    shutil.copytree(run111["ckpt"], src)
    step = resolve(src)
    before = H.tree_digest(src)
    for ckpt_arg, out in [(src, src / "m.safetensors"), (step, step / "m.safetensors"), (step, src / "m"),
                          (src, step / "tp00-pp00-dp00" / "m.safetensors")]:
        for force in (False, True):
            with pytest.raises(ConvertError, match=r"refusing to write into the source checkpoint"):
                convert(ckpt_arg, out, force=force)
    for force in (False, True):
        with pytest.raises(ConvertError, match=r"refusing to write into the source checkpoint"):
            convert(src, src, force=force)
        with pytest.raises(ConvertError, match=r"refusing to write into the source checkpoint"):
            reshard(src, src / "ck", 2, 1, 1, force=force)
        with pytest.raises(ConvertError, match=r"refusing to write into the source checkpoint"):
            reshard(step, step, 2, 1, 1, force=force)
    hf = convert(src, tmp_path / "hf", fmt="hf-gpt2", quiet=True)
    with pytest.raises(ConvertError, match=r"refusing to write into the source checkpoint"):
        split(hf, hf / "ck", 1, 1, 1)
    assert H.tree_digest(src) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "src"]
    r = H.cli("convert", src, "--out", step / "m.safetensors", "--force")
    H.one_line_error(r, "megalite convert: error: ", match=r"refusing to write into the source checkpoint")
    assert H.tree_digest(src) == before
