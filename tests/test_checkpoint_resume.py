"""Bit-exact resume: N steps straight == N/2 steps, a new process resuming from the checkpoint, N/2 more.
Same loss at every step (==) and byte-identical final model, optimizer and state files. Plus the ways
checkpoint.resume can be given (auto, a step folder, a missing path)."""
import json

import pytest

from helpers import CKPT, coord_files, copy_step, losses, ok, one_line_error, same_step_files, step_names, train

N = 6
DROPOUT = {"dropout": 0.1}  # the runs draw random numbers, so a resume must restore the RNG states too


def _compare_final(straight_root, split_root, step=N):
    a = straight_root / f"step_{step:08d}"
    b = split_root / f"step_{step:08d}"
    same_step_files(a, b)  # the straight and the resumed run end with the same files
    assert len(coord_files(a)) >= 3
    ma, mb = (json.loads((d / "manifest.json").read_text()) for d in (a, b))
    for key in ("step", "tokens_seen", "layout", "model", "optimizer_state", "optimizer", "data"):
        assert ma[key] == mb[key], key  # the slices' tensor checksums included
    assert {k: v["bytes"] for k, v in ma["files"].items()} == {k: v["bytes"] for k, v in mb["files"].items()}


def _resume_case(tmp_path, tokens, nproc, *par):
    cfg = CKPT.toml(tmp_path / "tiny.toml", tokens, model=DROPOUT)
    common = [f"--train.steps={N}", *par]
    straight = tmp_path / "straight"
    ok(train(cfg, *common, f"--checkpoint.dir={straight / 'ck'}", f"--train.out_dir={straight / 'out'}",
             nproc=nproc))
    split = tmp_path / "split"
    args = [*common, f"--checkpoint.dir={split / 'ck'}", f"--train.out_dir={split / 'out'}"]
    first = ok(train(cfg, *args, f"--train.stop_at_step={N // 2}", nproc=nproc))
    assert f"stopped by train.stop_at_step at step {N // 2}/{N}" in first.stdout
    assert step_names(split / "ck") == [f"step_{N // 2:08d}"]
    assert losses(split / "out") == losses(straight / "out")[:N // 2]
    second = ok(train(cfg, *args, "--checkpoint.resume=auto", nproc=nproc))
    assert f"resumed from {split / 'ck' / f'step_{N // 2:08d}'} at step {N // 2} (same layout)" in second.stdout
    want, got = losses(straight / "out"), losses(split / "out")
    assert [s for s, _ in want] == list(range(1, N + 1))
    assert got == want  # exact float equality at every step, the resumed half included
    _compare_final(straight / "ck", split / "ck")


def test_resume_bit_exact_single_process(tmp_path, token_file):
    _resume_case(tmp_path, token_file, 1)


@pytest.mark.parametrize("mode", ["sync", "zero1_async"])
def test_resume_bit_exact_tp2_pp2_dp2(tmp_path, token_file, mode):
    """Two launches instead of three (8 processes are slow on 2 cores): the straight run saves step N/2
    while it keeps training (async: the staged copy must not see later updates), and a new launch resumes
    from a copy of that step. The three-launch form (stop_at_step, then resume=auto in place) is the
    single-process case above."""
    cfg = CKPT.toml(tmp_path / "tiny.toml", token_file, model=DROPOUT)
    common = [f"--train.steps={N}", "--parallel.tp=2", "--parallel.pp=2", "--parallel.dp=2"]
    if mode == "zero1_async":
        common += ["--parallel.zero1=true", "--checkpoint.async=true"]
    straight = tmp_path / "straight"
    p = ok(train(cfg, *common, f"--checkpoint.dir={straight / 'ck'}", f"--checkpoint.interval={N // 2}",
                 f"--train.out_dir={straight / 'out'}", nproc=8))
    assert ("(async)" in p.stdout) == (mode == "zero1_async")
    assert step_names(straight / "ck") == [f"step_{N // 2:08d}", f"step_{N:08d}"]
    man = json.loads((straight / "ck" / f"step_{N // 2:08d}" / "manifest.json").read_text())
    assert man["layout"] == {"tp": 2, "pp": 2, "dp": 2, "zero1": mode == "zero1_async"}
    flat = any("flat" in sl for e in man["optimizer_state"].values() for sl in e["slices"])  # ZeRO-1 pieces
    assert flat or mode == "sync"
    split = tmp_path / "split"
    copy_step(straight / "ck" / f"step_{N // 2:08d}", split / "ck")
    second = ok(train(cfg, *common, f"--checkpoint.dir={split / 'ck'}", f"--train.out_dir={split / 'out'}",
                      "--checkpoint.resume=auto", nproc=8))
    assert f"at step {N // 2} (same layout)" in second.stdout
    assert losses(split / "out") == losses(straight / "out")[N // 2:]  # exact
    _compare_final(straight / "ck", split / "ck")


# ---------------------------------------------------------------- the forms of checkpoint.resume
@pytest.fixture(scope="module")
def base_run(tmp_path_factory, token_file):
    """A single-process run of N steps with a checkpoint every step (steps 1..N committed)."""
    d = tmp_path_factory.mktemp("base")
    cfg = CKPT.toml(d / "tiny.toml", token_file, model=DROPOUT)
    ok(train(cfg, f"--train.steps={N}", f"--checkpoint.dir={d / 'ck'}", "--checkpoint.interval=1",
             f"--train.out_dir={d / 'out'}"))
    return d


def test_resume_path_of_a_step_folder(tmp_path, base_run):
    step2 = base_run / "ck" / "step_00000002"
    out, ck = tmp_path / "out", tmp_path / "ck"
    p = ok(train(base_run / "tiny.toml", f"--train.steps={N}", f"--checkpoint.resume={step2}",
                 f"--checkpoint.dir={ck}", f"--train.out_dir={out}"))
    assert f"resumed from {step2} at step 2" in p.stdout
    got = losses(out)
    assert [s for s, _ in got] == list(range(3, N + 1))  # a new out_dir: only the steps this run did
    assert got == losses(base_run / "out")[2:]
    same_step_files(ck / f"step_{N:08d}", base_run / "ck" / f"step_{N:08d}")


def test_resume_path_of_a_root_means_latest(tmp_path, base_run):
    root = tmp_path / "copy"
    copy_step(base_run / "ck" / "step_00000004", root)
    out = tmp_path / "out"
    p = ok(train(base_run / "tiny.toml", f"--train.steps={N}", f"--checkpoint.resume={root}",
                 f"--train.out_dir={out}"))
    assert "at step 4" in p.stdout
    assert losses(out) == losses(base_run / "out")[4:]


@pytest.mark.parametrize("what", ["missing", "not_a_checkpoint", "auto_with_dangling_latest"])
def test_resume_path_that_is_not_a_checkpoint_fails(tmp_path, base_run, what):
    out, ck = tmp_path / "out", tmp_path / "ck"
    target = tmp_path / "nope"
    resume = str(target)
    if what == "not_a_checkpoint":
        target.mkdir()
        (target / "readme.txt").write_text("no checkpoint here")
    elif what == "auto_with_dangling_latest":  # `latest` names a step that is gone: an error, not a fresh start
        ck.mkdir()
        (ck / "latest").write_text("step_00000009\n")
        target, resume = ck, "auto"
    p = train(base_run / "tiny.toml", f"--checkpoint.resume={resume}", f"--checkpoint.dir={ck}",
              f"--train.out_dir={out}")
    line = one_line_error(p)
    assert "error" in line and str(target) in line, line
    # it never starts fresh: no step trained, nothing saved
    assert not (out / "metrics.jsonl").exists()
    assert not ck.exists() or step_names(ck) == []
    assert "step " not in p.stdout


def test_resume_auto_without_a_checkpoint_starts_fresh(tmp_path, base_run):
    out, ck = tmp_path / "out", tmp_path / "ck"
    p = ok(train(base_run / "tiny.toml", f"--train.steps={N}", "--train.stop_at_step=2", "--checkpoint.resume=auto",
                 f"--checkpoint.dir={ck}", f"--train.out_dir={out}"))
    assert "starting fresh" in p.stdout or "starts fresh" in p.stdout, p.stdout
    assert "resumed from" not in p.stdout
    assert losses(out) == losses(base_run / "out")[:2]
    assert step_names(ck) == ["step_00000002"]


def test_resume_auto_error_names_what_it_tried(tmp_path, base_run):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "latest").write_text("step_00000009\n")
    p = train(base_run / "tiny.toml", "--checkpoint.resume=auto", f"--checkpoint.dir={ck}",
              f"--train.out_dir={tmp_path / 'out'}")
    assert p.returncode == 2
    assert "step_00000009" in p.stdout + p.stderr
