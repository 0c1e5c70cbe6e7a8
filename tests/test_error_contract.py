"""The error contract against crafted, adversarial inputs: every user error is exactly one line on stderr
(`megalite <cmd>: error: ...` naming the file or field), exit code 2, no traceback, and nothing written or
left behind (no out_dir, no checkpoint folder, no lock, no `.tmp`, the inputs untouched).

The matrix runs `megalite.cli.main([...])` in this process (the CLI is a function: one process per case would
cost seconds each); test_error_contract_torchrun.py runs a few of the same inputs under a real 2-process
torchrun."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import helpers as H
from megalite.cli import main

STEP = "step_00000001"


@pytest.fixture(scope="module")
def world(inputs_world):
    """The session's read-only inputs (conftest.inputs_world): trained once, shared with test_bad_input."""
    return inputs_world


# ---------------------------------------------------------------- crafted inputs, made in the case folder
def _copy_ckpt(w, case, **_):
    shutil.copytree(w["ckpt"], case / "ck")


def _latest(content: bytes | None = None, *, folder=False, link=None):
    def make(w, case):
        _copy_ckpt(w, case)
        (case / "ck" / "latest").unlink()
        if folder:
            (case / "ck" / "latest").mkdir()
        elif link:
            (case / "ck" / "latest").symlink_to(link(w, case))
        else:
            (case / "ck" / "latest").write_bytes(content)
    return make


def _other_run(w, case):
    """`latest` naming a step of another run: ../../other/ckpt/step_00000001."""
    _copy_ckpt(w, case)
    shutil.copytree(w["ckpt"], case / "other" / "ckpt")
    (case / "ck" / "latest").write_text(f"../other/ckpt/{STEP}\n")


def _edit_json(rel: str, edit):
    def make(w, case):
        _copy_ckpt(w, case)
        path = case / "ck" / STEP / rel
        data = json.loads(path.read_text())
        edit(data)
        path.write_text(json.dumps(data))
        H.resign(case / "ck" / STEP, None if rel == "manifest.json" else rel)
    return make


def _state_not_object(w, case):
    _copy_ckpt(w, case)
    (case / "ck" / STEP / "tp00-pp00-dp00" / "state.json").write_text("[1, 2]")
    H.resign(case / "ck" / STEP, "tp00-pp00-dp00/state.json")


def _lock_symlink(w, case):
    _copy_ckpt(w, case)
    (case / "ck" / "lock").unlink()
    (case / "ck" / "lock").symlink_to(w["victim"])


def _lock_folder(w, case):
    _copy_ckpt(w, case)
    (case / "ck" / "lock").unlink()
    (case / "ck" / "lock").mkdir()


def _tokens(meta_edit=None, bad_ids=None):
    def make(w, case):
        shutil.copy(w["tokens"], case / "t.bin")
        meta = json.loads(w["tokens"].with_suffix(".json").read_text())
        if meta_edit:
            meta_edit(meta)
        (case / "t.json").write_text(json.dumps(meta))
        if bad_ids:  # a corrupt file: the tokens i with bad_ids(i, meta) are id 300
            data = bytearray((case / "t.bin").read_bytes())
            for i in range(len(data) // 2):
                if bad_ids(i, meta):
                    data[2 * i:2 * i + 2] = (300).to_bytes(2, "little")
            (case / "t.bin").write_bytes(bytes(data))
    return make


def _model_meta(value: str):
    def make(w, case):
        tensors = load_file(str(w["model"]))
        with safe_open(str(w["model"]), framework="pt") as f:
            meta = f.metadata()
        save_file(tensors, str(case / "m.safetensors"), metadata={**meta, "megalite.model_config": value})
    return make


def _hf_without(key: str):
    def make(w, case):
        shutil.copytree(w["hf"], case / "hf")
        cfg = json.loads((case / "hf" / "config.json").read_text())
        del cfg[key]
        (case / "hf" / "config.json").write_text(json.dumps(cfg))
    return make


def _source_inside(w, case):
    shutil.copytree(w["ckpt"], case / "parent" / "ck")


def _model_inside(w, case):
    (case / "parent").mkdir()
    shutil.copy(w["model"], case / "parent" / "m.safetensors")


T = ["train", "--config", "{toml}", "--train.out_dir={case}/run", "--checkpoint.dir={case}/newck"]
R = [*T[:3], "--train.out_dir={case}/run"]  # resume into the crafted folder itself: --checkpoint.dir given per case
CONVERT = ["convert", "{case}/ck", "--out", "{case}/m.safetensors"]

# id, argv ({toml} {ckpt} {model} {hf} {victim} from the world, {case} the case's own folder), fragments of the
# one stderr line, setup(world, case)
CASES = [
    # numbers in the config: finite, in range, the field named
    ("lr-nan", [*T, "--train.lr=nan"], ["train.lr = nan", "finite"], None),
    ("min-lr-inf", [*T, "--train.min_lr=inf"], ["train.min_lr = inf", "finite"], None),
    ("grad-clip-nan", [*T, "--train.grad_clip=nan"], ["train.grad_clip = nan"], None),
    ("beta1-one", [*T, "--train.beta1=1.0"], ["train.beta1 = 1.0", "[0, 1)"], None),
    ("beta2-negative", [*T, "--train.beta2=-0.5"], ["train.beta2 = -0.5", "[0, 1)"], None),
    ("bucket-zero", [*T, "--parallel.bucket_mb=0"], ["parallel.bucket_mb = 0.0", "positive"], None),
    ("bucket-nan", [*T, "--parallel.bucket_mb=nan"], ["parallel.bucket_mb = nan", "finite"], None),
    ("weight-decay-inf", [*T, "--train.weight_decay=inf"], ["train.weight_decay = inf"], None),
    ("dropout-nan", [*T, "--model.dropout=nan"], ["model.dropout = nan"], None),
    ("val-fraction-nan", [*T, "--data.val_fraction=nan"], ["data.val_fraction = nan"], None),
    ("data-path-empty", [*T, "--data.path="], ["data.path is empty"], None),
    ("out-dir-empty", [*T[:3], "--train.out_dir="], ["train.out_dir is empty"], None),
    ("on-nonfinite", [*T, "--train.on_nonfinite=maybe"], ["train.on_nonfinite", "'stop' or 'skip'"], None),
    ("seed-negative", [*T, "--train.seed=-3"], ["train.seed = -3"], None),
    # the data against the model, before step 1
    ("data-vocab-larger", [*T, "--data.path={case}/t.bin"], ["t.json", "vocab_size 512", "model.vocab_size = 256"],
     _tokens(lambda m: m.update(vocab_size=512))),
    ("data-ids-too-big", [*T, "--model.vocab_size=64"], ["token id", "model.vocab_size = 64"], None),
    ("data-corrupt-ids", [*T, "--data.path={case}/t.bin"], ["t.bin", "id 300", "max_token", "corrupt"],
     _tokens(bad_ids=lambda i, meta: i >= 5 and i % 97 == 0)),  # every 97th token: the start-up sample sees them
    ("data-max-token-type", [*T, "--data.path={case}/t.bin"], ["max_token", "'lots'"],
     _tokens(lambda m: m.update(max_token="lots"))),
    # resume: bad checkpoints and hostile roots; nothing left behind (no lock, no out_dir)
    ("resume-missing", [*T, "--checkpoint.resume={case}/nope"], ["nope", "does not exist"], None),
    ("resume-latest-other-run", [*R, "--checkpoint.dir={case}/ck", "--checkpoint.resume={case}/ck"],
     ["latest", "names a step folder of this checkpoint", "../other"], _other_run),
    ("resume-auto-latest-other-run-alone", [*R, "--checkpoint.dir={case}/ck2", "--checkpoint.resume=auto"],
     ["latest", "no other checkpoint"], lambda w, case: (case / "ck2").mkdir() or
     (case / "ck2" / "latest").write_text(f"../ck/{STEP}\n") or _copy_ckpt(w, case)),
    ("resume-latest-not-utf8", [*T, "--checkpoint.resume={case}/ck"], ["latest", "not UTF-8"],
     _latest(b"\xff\xfe\x00step")),
    ("resume-latest-folder", [*T, "--checkpoint.resume={case}/ck"], ["latest", "folder"], _latest(folder=True)),
    ("resume-latest-symlink", [*T, "--checkpoint.resume={case}/ck"], ["latest", "symlink"],
     _latest(link=lambda w, case: w["ckpt"] / "latest")),
    ("resume-lock-symlink", [*R, "--checkpoint.dir={case}/ck", "--checkpoint.resume=auto"], ["lock", "symlink"],
     _lock_symlink),
    ("resume-lock-folder", [*R, "--checkpoint.dir={case}/ck", "--checkpoint.resume=auto"], ["lock"], _lock_folder),
    ("resume-bad-rng", [*T, "--checkpoint.resume={case}/ck"], ["state.json", "'rng'"],
     _edit_json("tp00-pp00-dp00/state.json", lambda s: s.update(rng={"python": "garbage"}))),
    ("resume-state-not-object", [*T, "--checkpoint.resume={case}/ck"], ["state.json", "not a JSON object"],
     _state_not_object),
    ("resume-tokens-seen-type", [*T, "--checkpoint.resume={case}/ck"], ["tokens_seen", "'many'"],
     _edit_json("manifest.json", lambda m: m.update(tokens_seen="many"))),
    # verify / inspect / convert of the same hostile roots
    ("inspect-latest-not-utf8", ["inspect", "{case}/ck"], ["latest", "not UTF-8"], _latest(b"\xff\xff")),
    ("inspect-latest-folder", ["inspect", "{case}/ck", "--tree"], ["latest", "folder"], _latest(folder=True)),
    ("convert-latest-other-run", CONVERT, ["latest", "../other"], _other_run),
    ("convert-latest-symlink", CONVERT, ["latest", "symlink"], _latest(link=lambda w, case: w["ckpt"] / "latest")),
    # output safety
    ("convert-out-dot", ["convert", "{ckpt}", "--out", "."], ["--out '.'", "new file or folder"], None),
    ("convert-out-root", ["convert", "{ckpt}", "--out", "/", "--force"], ["--out '/'"], None),
    ("convert-out-holds-cwd", ["convert", "{ckpt}", "--out", "{case}", "--force"], ["current directory"], None),
    ("convert-out-contains-source", ["convert", "{case}/parent/ck", "--out", "{case}/parent", "--force"],
     ["contains the source"], _source_inside),
    ("reshard-out-contains-source", ["reshard", "{case}/parent/ck", "--tp", "1", "--pp", "1", "--dp", "1",
                                     "--out", "{case}/parent", "--force"], ["contains the source"], _source_inside),
    ("split-out-contains-source", ["split", "{case}/parent/m.safetensors", "--tp", "1", "--pp", "1", "--dp", "1",
                                   "--out", "{case}/parent", "--force"], ["contains the source"], _model_inside),
    ("reshard-out-live-lock", ["reshard", "{ckpt}", "--tp", "1", "--pp", "1", "--dp", "1", "--out", "{case}/live",
                               "--force"], ["live", "lock", "a training run holds"], "live-lock"),
    # model files and HF folders
    ("split-meta-not-json", ["split", "{case}/m.safetensors", "--tp", "1", "--pp", "1", "--dp", "1", "--out",
                             "{case}/o"], ["m.safetensors", "megalite.model_config", "not valid JSON"],
     _model_meta("{not json")),
    ("split-meta-wrong-type", ["split", "{case}/m.safetensors", "--tp", "1", "--pp", "1", "--dp", "1", "--out",
                               "{case}/o"], ["m.safetensors", "model.n_layer", "str", "int"],
     _model_meta(json.dumps({"n_layer": "2", "n_head": 4, "n_embd": 32, "block_size": 16, "vocab_size": 256,
                             "dropout": 0.0}))),
    ("split-meta-list", ["split", "{case}/m.safetensors", "--tp", "1", "--pp", "1", "--dp", "1", "--out",
                         "{case}/o"], ["megalite.model_config", "expected a table"], _model_meta("[1, 2]")),
    ("split-hf-without-n-head", ["split", "{case}/hf", "--tp", "1", "--pp", "1", "--dp", "1", "--out", "{case}/o"],
     ["config.json", "'n_head' is missing"], _hf_without("n_head")),
    ("generate-meta-not-json", ["generate", "--model", "{case}/m.safetensors"], ["not valid JSON"],
     _model_meta("{not json")),
    ("generate-meta-negative", ["generate", "--model", "{case}/m.safetensors"], ["model.n_embd = -32"],
     _model_meta(json.dumps({"n_layer": 2, "n_head": 4, "n_embd": -32, "block_size": 16, "vocab_size": 256,
                             "dropout": 0.0}))),
    ("generate-hf-without-n-head", ["generate", "--model", "{case}/hf"], ["'n_head' is missing"],
     _hf_without("n_head")),
    # generate flags
    ("generate-prompt-not-utf8", ["generate", "--model", "{model}", "--prompt", "\udcff"], ["--prompt", "UTF-8"],
     None),
    ("generate-top-k-negative", ["generate", "--model", "{model}", "--top-k", "-5"], ["--top-k -5"], None),
    ("generate-temperature-nan", ["generate", "--model", "{model}", "--temperature", "nan"],
     ["--temperature nan", "finite"], None),
    ("generate-max-new-negative", ["generate", "--model", "{model}", "--max-new-tokens", "-1"],
     ["--max-new-tokens -1"], None),
    ("generate-max-new-huge", ["generate", "--model", "{model}", "--max-new-tokens", str(10**15)],
     [f"--max-new-tokens {10**15}", "<= 16777216"], None),
    # manifests and safetensors headers of the wrong types (read through the typed manifest of issue 10)
    ("inspect-manifest-files-key", ["inspect", "{case}/ck"], ["manifest.json"],
     _edit_json("manifest.json", lambda m: m["files"].update({"x.safetensors": {"bytes": 1, "crc32": "0"}}))),
    ("inspect-manifest-model-list", ["inspect", "{case}/ck"], ["manifest.json", "model"],
     _edit_json("manifest.json", lambda m: m.update(model=[1]))),
    ("resume-manifest-layout-str", [*T, "--checkpoint.resume={case}/ck"], ["manifest.json", "tp"],
     _edit_json("manifest.json", lambda m: m["layout"].update(tp="1"))),
]
# (the typed manifest of issue 10 turned the last known bugs here green: a strict xfail list would go here)
KNOWN_BUGS: dict = {}


def _snapshot(root: Path) -> dict:
    """Every path under root (symlinks not followed) with its kind, size, mtime (files) and small files' bytes.
    A folder's own mtime is left out: the start-up probe that the folder is writable creates and removes a file."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        st = p.lstat()
        small = p.is_file() and not p.is_symlink() and st.st_size < 4096
        out[str(p.relative_to(root))] = (p.is_symlink(), p.is_dir(), st.st_size,
                                         None if p.is_dir() else st.st_mtime_ns, p.read_bytes() if small else None)
    return out


def run_cli(argv: list, capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line(rc: int, out: str, err: str, command: str, fragments: list) -> str:
    shown = f"exit {rc}\n--- stdout\n{out[-2000:]}\n--- stderr\n{err[-3000:]}"
    assert rc == 2, shown
    assert "Traceback" not in out + err, shown
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"megalite {command}: error: "), shown
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


@pytest.mark.parametrize("name,argv,fragments,setup", [
    pytest.param(*c, id=c[0], marks=[pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[c[0]])] if c[0] in KNOWN_BUGS
                 else []) for c in CASES])
def test_crafted_input_is_one_line_exit_2_and_writes_nothing(tmp_path, world, capsys, monkeypatch, name, argv,
                                                             fragments, setup):
    case = tmp_path / "case"
    case.mkdir()
    held = None
    if setup == "live-lock":  # a live training run's folder: its lock held (here by this process)
        (case / "live").mkdir()
        held = os.open(case / "live" / "lock", os.O_RDWR | os.O_CREAT)
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    elif setup is not None:
        setup(world, case)
    paths = {k: str(v) for k, v in world.items()} | {"case": str(case)}
    args = [a.format(**paths) for a in argv]
    before, world_before = _snapshot(case), _snapshot(world["dir"])
    monkeypatch.chdir(case)
    try:
        rc, out, err = run_cli(args, capsys)
    finally:
        if held is not None:
            os.close(held)
    for i, f in enumerate(fragments):
        fragments[i] = f.format(**paths)
    assert_one_line(rc, out, err, args[0], fragments)
    assert out == "", out
    assert _snapshot(case) == before, "the command wrote, moved or left something"
    assert _snapshot(world["dir"]) == world_before, "the command touched its inputs"


def test_the_matrix_covers_every_command():
    commands = {argv[0] for _, argv, _, _ in CASES} | {"verify"}
    assert len(CASES) - len(KNOWN_BUGS) >= 40 and commands >= {"train", "inspect", "convert", "split", "reshard", "generate"}
    assert sum("resume" in name for name, *_ in CASES) >= 8


def test_a_corrupt_id_the_start_up_sample_missed_stops_at_its_batch(tmp_path, world, capsys, monkeypatch):
    """A large file is only sampled at start-up (every len/SAMPLE_TOKENS-th token): ids the sample missed are
    caught in the batch that reads them, on every rank alike, before they reach the embedding."""
    import megalite.data
    monkeypatch.setattr(megalite.data, "SAMPLE_TOKENS", 1)  # a sample of one token per split: its first
    case = tmp_path / "case"
    case.mkdir()
    _tokens(bad_ids=lambda i, meta: i not in (0, meta["val_start"]))(world, case)  # all but the sampled ones
    rc, out, err = run_cli([*[a.format(toml=world["toml"], case=case) for a in T], f"--data.path={case}/t.bin",
                            "--train.steps=2"], capsys)
    assert_one_line(rc, out, err, "train", ["token id 300", "at token", "model.vocab_size = 256", "corrupt"])
    assert not (case / "run").exists() or not (case / "run" / "metrics.jsonl").read_text().strip()


def test_verify_names_a_hostile_latest_and_exits_1(tmp_path, world, capsys):
    """verify's own contract: problems on stdout, one line each, a summary line on stderr, exit 1."""
    for make in (_latest(b"\xff"), _other_run):
        case = tmp_path / f"c{id(make)}"
        case.mkdir()
        make(world, case)
        rc, out, err = run_cli(["verify", case / "ck"], capsys)
        assert rc == 1 and len(out.splitlines()) == 1 and "latest" in out and "Traceback" not in err, (out, err)


def test_an_os_error_while_writing_is_one_line_and_leaves_no_temp(tmp_path, world, capsys, monkeypatch):
    """A read-only filesystem (EROFS) when the output is moved into place: one line naming the cause; the
    temporary output is removed and an existing output is kept (one megalite wrote: --force replaces no
    other file since issue 21)."""
    import megalite.convert.common as common
    out = tmp_path / "o"
    out.mkdir()
    shutil.copy(world["model"], out / "m.safetensors")
    keep = (out / "m.safetensors").read_bytes()
    real = os.replace

    def read_only(src, dst, *a, **k):
        if str(src).endswith(".tmp-megalite"):
            raise OSError(errno.EROFS, "Read-only file system", str(dst))
        return real(src, dst, *a, **k)

    monkeypatch.setattr(common.os, "replace", read_only)
    for extra in ([], ["--force"]):
        rc, so, se = run_cli(["convert", world["ckpt"], "--out", out / "m.safetensors", *extra], capsys)
        if not extra:
            assert_one_line(rc, so, se, "convert", ["already exists"])
            continue
        assert_one_line(rc, so, se, "convert", ["Read-only file system", "m.safetensors"])
    assert sorted(p.name for p in out.iterdir()) == ["m.safetensors"]
    assert (out / "m.safetensors").read_bytes() == keep


def test_debug_switch_prints_the_traceback(tmp_path, world, capsys, monkeypatch):
    monkeypatch.setenv("MEGALITE_DEBUG", "1")
    rc, out, err = run_cli(["inspect", tmp_path / "nothing"], capsys)
    assert rc == 2 and "Traceback" in err and err.splitlines()[-1].startswith("megalite inspect: error: "), err
