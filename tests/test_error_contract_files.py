"""The error contract, round three (issue 21, classes 2, 3 and 5), in the matrix style of test_error_contract.py:
each crafted input is one line on stderr, exit 2, no traceback, nothing written or moved (the case folder and
the shared inputs byte-identical afterwards), and nothing blocks (a guard ends a case that waits on a FIFO).

  - files megalite manages that are not regular files of their folder: a symlinked, FIFO or folder
    metrics.jsonl, a FIFO .json beside a token file, a step folder that is a symlink under resume=auto, a FIFO
    where a convert --force output's lock would be, a FIFO named as a prepare source;
  - outputs that would replace good data: prepare --out over an existing file (with or without sources), and
    --force over anything megalite did not write (a user's file, a folder of other files, a .json beside --out,
    a symlink, an output of another kind), for prepare, convert (both formats), split and reshard;
  - numbers that pass a type check but not their consumer: a seed, a vocabulary or a batch beyond the C type
    they end in, a timeout beyond int64 nanoseconds, a learning rate whose first update overflows float32,
    counters in a manifest or state.json beyond any real run, generate's seed.

The same inputs that are not errors (what --force may replace, a tiny temperature) are tested below the matrix.
"""
from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
from safetensors.torch import load_file

from helpers import CKPT, metrics_lines, train_in_process
from test_error_contract import STEP, T, _edit_json, _snapshot, assert_one_line, run_cli, world  # noqa: F401
from megalite.checkpoint.tree import read_latest
from megalite.checkpoint.verify import verify

R = [*T[:3], "--train.out_dir={case}/run"]  # resume into the crafted folder itself: --checkpoint.dir per case
BIG = 2**70  # a counter no run reaches
GUARD_S = 60  # a case still running after this is blocked (on a FIFO, say): it fails instead of hanging


# ---------------------------------------------------------------- crafted inputs, made in the case folder
def _in_run(make):
    """`make(path)` at <case>/run/metrics.jsonl, the run folder made first."""
    def setup(w, case):
        (case / "run").mkdir()
        make(w, case / "run" / "metrics.jsonl")
    return setup


def _fifo(rel: str):
    def setup(w, case):
        (case / rel).parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(case / rel)
    return setup


def _token_json_fifo(w, case):
    shutil.copy(w["tokens"], case / "t.bin")
    os.mkfifo(case / "t.json")


def _step_symlink(w, case):
    """A root whose `latest` names step_00000001, a symlink to the shared checkpoint's step (elsewhere)."""
    (case / "ck").mkdir()
    (case / "ck" / STEP).symlink_to(w["ckpt"] / STEP)
    (case / "ck" / "latest").write_text(STEP + "\n")


def _files(**files):
    """Files of the case: {name: text}; a value of None makes a folder holding notes.txt."""
    def setup(w, case):
        for name, text in files.items():
            if text is None:
                (case / name).mkdir()
                (case / name / "notes.txt").write_text("my notes\n")
            else:
                (case / name).write_text(text)
    return setup


def _link(name: str):
    def setup(w, case):
        (case / "a.txt").write_text("some text\n")
        (case / name).symlink_to(w["victim"])
    return setup


def _copy(key: str, name: str):
    def setup(w, case):
        shutil.copytree(w[key], case / name)
    return setup


P = ["prepare", "{case}/a.txt", "--out", "{case}/mine.bin"]
TEXT = {"a.txt": "some text\n"}
CONVERT = ["convert", "{ckpt}", "--out"]
LAYOUT = ["--tp", "1", "--pp", "1", "--dp", "1", "--out"]

# id, argv ({toml} {ckpt} {model} {hf} {victim} from the world, {case} the case's own folder), fragments of the
# one stderr line, setup(world, case)
CASES = [
    # class 2: files of the run folder, the token file and the checkpoint root that are not regular files there
    ("train-metrics-symlink", T, ["metrics.jsonl", "symbolic link", "remove it"],
     _in_run(lambda w, p: p.symlink_to(w["victim"]))),
    ("train-metrics-fifo", T, ["metrics.jsonl", "named pipe"], _in_run(lambda w, p: os.mkfifo(p))),
    ("train-metrics-folder", T, ["metrics.jsonl", "a folder"], _in_run(lambda w, p: p.mkdir())),
    ("train-token-json-fifo", [*T, "--data.path={case}/t.bin"], ["t.json", "named pipe", "regular file"],
     _token_json_fifo),
    ("resume-auto-step-symlink", [*R, "--checkpoint.dir={case}/ck", "--checkpoint.resume=auto"],
     ["resume=auto", STEP, "symbolic link", "real folder"], _step_symlink),
    ("convert-force-lock-fifo", [*CONVERT, "{case}/out", "--force"], ["out", "a folder"], _fifo("out/lock")),
    ("prepare-source-fifo", ["prepare", "{case}/pipe", "--out", "{case}/t.bin"], ["pipe", "named pipe"],
     _fifo("pipe")),
    # class 3: outputs that would replace what megalite did not write
    ("prepare-out-exists", P, ["mine.bin", "already exists", "--force"], _files(**TEXT, **{"mine.bin": "mine"})),
    ("prepare-default-corpus-over-existing", ["prepare", "--out", "{case}/mine.bin"], ["mine.bin", "already exists"],
     _files(**{"mine.bin": "mine"})),
    ("prepare-json-beside-out-exists", P, ["mine.json", "beside --out", "already exists"],
     _files(**TEXT, **{"mine.json": '{"my": "settings"}'})),
    ("prepare-force-not-a-token-file", [*P, "--force"], ["mine.bin", "not a token file", "no 'mine.json'"],
     _files(**TEXT, **{"mine.bin": "mine"})),
    ("prepare-force-json-not-ours", [*P, "--force"], ["mine.json", "not a 'megalite-tokens'"],
     _files(**TEXT, **{"mine.json": '{"my": "settings"}'})),
    ("prepare-force-out-symlink", [*P, "--force"], ["mine.bin", "symbolic link"], _link("mine.bin")),
    ("convert-force-user-file", [*CONVERT, "{case}/m.safetensors", "--force"], ["m.safetensors", "megalite.kind"],
     _files(**{"m.safetensors": "keep me"})),
    ("convert-force-folder-of-files", [*CONVERT, "{case}/stuff", "--force"], ["stuff", "a folder",
                                                                              "remove it yourself"],
     _files(stuff=None)),
    ("convert-hf-force-folder-of-files", [*CONVERT, "{case}/stuff", "--format", "hf-gpt2", "--force"],
     ["stuff", "HF GPT-2 folder", "notes.txt"], _files(stuff=None)),
    ("convert-force-over-an-hf-folder", [*CONVERT, "{case}/hf", "--force"], ["hf", "a folder"], _copy("hf", "hf")),
    ("convert-force-out-symlink", [*CONVERT, "{case}/m.safetensors", "--force"], ["symbolic link"],
     _link("m.safetensors")),
    ("reshard-force-folder-of-files", ["reshard", "{ckpt}", *LAYOUT, "{case}/stuff", "--force"],
     ["stuff", "notes.txt", "not part of a megalite checkpoint"], _files(stuff=None)),
    ("split-force-folder-of-files", ["split", "{model}", *LAYOUT, "{case}/stuff", "--force"],
     ["stuff", "notes.txt"], _files(stuff=None)),
    ("split-force-over-a-model-file", ["split", "{model}", *LAYOUT, "{case}/m.safetensors", "--force"],
     ["m.safetensors", "checkpoint root"], lambda w, case: shutil.copy(w["model"], case / "m.safetensors")),
    # class 5: numbers in range for their type, out of range for their consumer
    ("seed-beyond-int64", [*T, "--train.seed=18446744073709551616"], ["train.seed = 18446744073709551616",
                                                                      "too large"], None),
    ("vocab-beyond-int64", [*T, "--model.vocab_size=18446744073709551616"], ["model.vocab_size", "too large"], None),
    ("global-batch-beyond-int64", [*T, "--train.global_batch_size=9223372036854775808"],
     ["train.global_batch_size", "too large"], None),
    ("timeout-beyond-int64-ns", [*T, "--parallel.timeout_s=1e300"], ["parallel.timeout_s", "int64 nanoseconds"],
     None),
    ("lr-overflows-float32", [*T, "--train.lr=1e38", "--train.min_lr=0"], ["train.lr = 1e+38", "float32"], None),
    ("eval-batches-beyond-streams", [*T, "--train.eval_batches=5000000000"], ["train.eval_batches", "too large"],
     None),
    ("config-show-seed-beyond-int64", ["config", "show", "--train.seed=18446744073709551616"], ["train.seed"], None),
    ("resume-manifest-step-beyond-any-run", [*T, "--checkpoint.resume={case}/ck"], ["manifest.json", "'step'",
                                                                                   "<= 9007199254740991"],
     _edit_json("manifest.json", lambda m: m.update(step=BIG))),
    ("resume-state-step-beyond-any-run", [*T, "--checkpoint.resume={case}/ck"], ["state.json", "'step'"],
     _edit_json("tp00-pp00-dp00/state.json", lambda s: s.update(step=BIG))),
    ("resume-batch-index-beyond-any-run", [*T, "--checkpoint.resume={case}/ck"], ["batch_index"],
     _edit_json("manifest.json", lambda m: m["data"].update(batch_index=BIG))),
    ("generate-seed-beyond-uint64", ["generate", "--model", "{model}", "--seed", str(2**64)], ["--seed", "generator"],
     None),
    ("generate-seed-negative", ["generate", "--model", "{model}", "--seed", "-1"], ["--seed -1"], None),
    ("split-step-negative", ["split", "{model}", *LAYOUT, "{case}/o", "--step", "-1"], ["--step -1"], None),
    # a layout of 10**20 ranks once enumerated its coordinates (a folder each) until killed
    ("split-world-beyond-any-run", ["split", "{model}", "--tp", "1", "--pp", "1", "--dp", str(10**20), "--out",
                                    "{case}/o"], ["--dp = 100000000000000000000", "131072"], None),
    ("reshard-world-beyond-any-run", ["reshard", "{ckpt}", "--tp", "2", "--pp", "1", "--dp", str(10**9), "--out",
                                      "{case}/o"], ["2000000000", "more ranks than"], None),
]


class Blocked(Exception):
    pass


def _blocked(signum, frame):
    raise Blocked(f"still running after {GUARD_S} s: blocked (on a FIFO?) or never ending")


@pytest.mark.parametrize("name,argv,fragments,setup", [pytest.param(*c, id=c[0]) for c in CASES])
def test_crafted_input_is_one_line_exit_2_and_writes_nothing(tmp_path, world, capsys, monkeypatch, name, argv,
                                                             fragments, setup):
    case = tmp_path / "case"
    case.mkdir()
    if setup is not None:
        setup(world, case)
    paths = {k: str(v) for k, v in world.items()} | {"case": str(case)}
    args = [a.format(**paths) for a in argv]
    before, world_before = _snapshot(case), _snapshot(world["dir"])
    monkeypatch.chdir(case)
    old = signal.signal(signal.SIGALRM, _blocked)
    signal.alarm(GUARD_S)
    try:
        rc, out, err = run_cli(args, capsys)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert_one_line(rc, out, err, args[0], [f.format(**paths) for f in fragments])
    assert out == "", out
    assert _snapshot(case) == before, "the command wrote, moved or left something"
    assert _snapshot(world["dir"]) == world_before, "the command touched its inputs (a symlink's target?)"


def test_the_matrix_covers_the_three_classes_and_every_command():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)
    commands = {argv[0] for _, argv, _, _ in CASES}
    assert commands >= {"train", "convert", "split", "reshard", "prepare", "generate", "config"}


# ---------------------------------------------------------------- what is allowed, beside what is refused
def test_force_replaces_an_output_megalite_wrote_of_the_same_kind(tmp_path, world, capsys):
    """--force still does its job: each kind of output megalite wrote (a token file, a model file, an HF folder,
    a checkpoint root) is replaced by a new one of its kind; the old is gone, no temporary name is left."""
    from megalite.data import TokenDataset, prepare
    (tmp_path / "a.txt").write_text("first text, long enough\n")
    (tmp_path / "b.txt").write_text("second\n")
    prepare([tmp_path / "a.txt"], tmp_path / "t.bin", log=lambda *a: None)
    rc, _, err = run_cli(["prepare", tmp_path / "b.txt", "--out", tmp_path / "t.bin", "--force", "--quiet"], capsys)
    assert rc == 0, err
    train = TokenDataset(tmp_path / "t.bin", "train", 0.5).tokens  # b.txt's 7 tokens: 7 - int(3.5) = 4 train
    assert bytes(train.astype("uint8")) == b"seco"
    outs = {"megalite": tmp_path / "m.safetensors", "hf-gpt2": tmp_path / "hf"}
    for fmt, out in outs.items():
        for _ in range(2):  # the second time over the first's output
            rc, _, err = run_cli(["convert", world["ckpt"], "--out", out, "--format", fmt, "--force", "--quiet"],
                                 capsys)
            assert rc == 0, err
    assert set(load_file(str(outs["megalite"]))) == set(load_file(str(world["model"])))
    for layout in ("2", "1"):
        rc, _, err = run_cli(["reshard", world["ckpt"], "--tp", layout, "--pp", "1", "--dp", "1", "--out",
                              tmp_path / "ck", "--force", "--quiet"], capsys)
        assert rc == 0, err
    assert verify(tmp_path / "ck")[1] == [] and read_latest(tmp_path / "ck") == STEP
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "ck", "hf", "m.safetensors", "t.bin",
                                                          "t.json"]


def test_a_symlinked_step_folder_under_resume_auto_falls_back_to_a_real_one(tmp_path, world, token_file):
    """`latest` names a step folder that is a symlink (to another run's step): resume=auto refuses it, as
    `verify ROOT` does, says so, and resumes from the newest real step folder instead."""
    root = tmp_path / "ck"
    shutil.copytree(world["ckpt"], root)
    os.unlink(root / "lock")
    (root / "step_00000009").symlink_to(world["ckpt"] / STEP)
    (root / "latest").write_text("step_00000009\n")
    assert verify(root)[1] and "symlink" in verify(root)[1][0]
    logs = []
    cfg = CKPT.config(token_file, tmp_path / "run", **{"model.n_layer": 2, "train.steps": 2,
                                                       "checkpoint.dir": str(root)})
    tr = train_in_process(cfg, log=logs.append)
    assert any("skipping" in line and "step_00000009" in line and "symbolic link" in line for line in logs), logs
    assert any(line.startswith(f"resumed from {root / STEP} at step 1") for line in logs), logs
    assert tr.step == 2 and (root / "step_00000009").is_symlink()


def test_run_folder_files_shared_by_hard_links_are_never_written_through(tmp_path, world, token_file):
    """A run folder branched with `cp -al` shares metrics.jsonl and the checkpoint lock with the original by
    hard links. Resuming the branch appends to a copy of its own (the original's record keeps its bytes) and
    takes a lock of its own (the original may be live: its lock is held here). A symlinked errors.log is never
    appended through when a run fails."""
    import fcntl
    orig, branch = tmp_path / "orig", tmp_path / "branch"
    train_in_process(CKPT.config(token_file, orig, **{"model.n_layer": 2, "train.steps": 1,
                                                      "checkpoint.dir": str(orig / "checkpoints")}))
    shutil.copytree(orig, branch, copy_function=os.link)  # cp -al
    assert os.stat(branch / "metrics.jsonl").st_nlink == 2 and os.stat(branch / "checkpoints" / "lock").st_nlink == 2
    record = (orig / "metrics.jsonl").read_bytes()
    held = os.open(orig / "checkpoints" / "lock", os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the original run, live
    try:
        logs = []
        tr = train_in_process(CKPT.config(token_file, branch, **{"model.n_layer": 2, "train.steps": 2,
                                                                 "checkpoint.dir": str(branch / "checkpoints")}),
                              log=logs.append)
    finally:
        os.close(held)
    assert tr.step == 2 and any("hard links" in line for line in logs), logs
    assert (orig / "metrics.jsonl").read_bytes() == record
    assert [r.get("step") for r in metrics_lines(branch)] == [1, 1, 2]  # step 1, the resume event, step 2
    assert os.stat(branch / "metrics.jsonl").st_nlink == 1 and os.stat(orig / "metrics.jsonl").st_nlink == 1
    # errors.log a symlink to a file of the user's: a failing run (a NaN loss) leaves it untouched
    (branch / "errors.log").symlink_to(world["victim"])
    before = world["victim"].read_bytes()
    from megalite.base.errors import NonFiniteError
    with pytest.raises(NonFiniteError):
        train_in_process(CKPT.config(token_file, branch, **{
            "model.n_layer": 2, "train.steps": 4, "checkpoint.dir": "", "train.lr": 1e5, "train.min_lr": 0.0,
            "train.grad_clip": 0.0, "train.warmup_steps": 0}))
    assert world["victim"].read_bytes() == before and (branch / "errors.log").is_symlink()


def test_verify_reports_a_fifo_and_never_waits_on_it(tmp_path, world, capsys):
    """A FIFO where the manifest, a state.json or a shard should be: one problem line naming it, exit 1."""
    for rel, fragment in (("manifest.json", "named pipe"), ("tp00-pp00-dp00/state.json", "state.json"),
                          ("tp00-pp00-dp00/model.safetensors", "model.safetensors")):
        root = tmp_path / rel.replace("/", "-")
        shutil.copytree(world["ckpt"], root)
        os.unlink(root / STEP / rel)
        os.mkfifo(root / STEP / rel)
        old = signal.signal(signal.SIGALRM, _blocked)
        signal.alarm(GUARD_S)
        try:
            rc, out, err = run_cli(["verify", root / STEP], capsys)
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
        assert rc == 1 and len(out.splitlines()) == 1 and fragment in out and "Traceback" not in err, (rel, out, err)


def test_a_tiny_temperature_samples_the_likeliest_token_like_greedy(world):
    """Temperature 1e-45 (the smallest positive float32) once made the softmax NaN (a traceback); its limit is
    greedy decoding, the reference: the same tokens as temperature 0 (argmax)."""
    from megalite.generate import generate, load_model
    model = load_model(world["model"])
    ids = list(b"def ")
    greedy = generate(model, ids, max_new_tokens=8, temperature=0.0, warn=lambda m: None)
    for t in (1e-45, 1e-30, 5e-324):
        assert generate(model, ids, max_new_tokens=8, temperature=t, seed=3, warn=lambda m: None) == greedy, t


def test_data_val_fraction_decides_the_split_whatever_the_file_recorded(tmp_path, token_file):
    """data.val_fraction (class 7: a setting once read by nothing) holds out the last share of the tokens. The
    reference is prepare's own split: a run with data.val_fraction=0.5 on a file prepared at 0.1 evaluates
    exactly as the same run on the file prepared at 0.5, and differently from data.val_fraction=0.1."""
    from megalite.data import prepare
    corpus = Path(token_file).with_name("corpus.txt")
    files = {}
    for frac in (0.1, 0.5):
        files[frac] = tmp_path / f"t{frac}.bin"
        prepare([corpus], files[frac], val_fraction=frac, log=lambda *a: None)

    def val_losses(path, frac):
        cfg = CKPT.config(path, tmp_path / f"run-{path.stem}-{frac}", **{
            "model.n_layer": 2, "train.steps": 2, "train.eval_interval": 1, "data.val_fraction": frac})
        return [r["val_loss"] for r in train_in_process(cfg).history]

    half = val_losses(files[0.5], 0.5)
    assert val_losses(files[0.1], 0.5) == half
    assert val_losses(files[0.1], 0.1) != half
