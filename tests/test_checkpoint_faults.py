"""What goes wrong in real life: a rank killed mid-save, corrupted or truncated files, preemption by
SIGTERM, pruning, mismatched configs and format versions, stale temporary folders, a rank that cannot
write. The checkpoint `latest` names must always be whole, and every refusal is one line naming the cause."""
import errno
import json
import os
import random
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from helpers import (CKPT, assert_still_at_step_1, children, cli, copy_step, kill_tree, losses, metrics, ok,
                     one_line_error, popen_train, same_on_every_rank, step_names, tmp_dirs, train, verify_cli, wait_for)
from megalite.checkpoint.tree import committed_steps, read_latest
from megalite.checkpoint.manifest import FORMAT_VERSION
from megalite.testing import run_parallel

MODEL = "tp00-pp00-dp00/model.safetensors"
OPTIM = "tp00-pp00-dp00/optimizer.safetensors"


# ---------------------------------------------------------------- a single-process checkpoint to damage
@pytest.fixture(scope="module")
def base(tmp_path_factory, token_file):
    """Steps 1 and 2 of a single-process run, both committed."""
    d = tmp_path_factory.mktemp("faults-base")
    cfg = CKPT.toml(d / "tiny.toml", token_file)
    ok(train(cfg, "--train.steps=6", "--train.stop_at_step=2", f"--checkpoint.dir={d / 'ck'}",
             "--checkpoint.interval=1", f"--train.out_dir={d / 'out'}"))
    assert step_names(d / "ck") == ["step_00000001", "step_00000002"]
    return d


@pytest.fixture
def damaged(tmp_path, base):
    """A private copy of step 2 (as a root whose `latest` names it) to corrupt."""
    return copy_step(base / "ck" / "step_00000002", tmp_path / "ck")


def _resume(base, path, tmp_path, *extra):
    return train(base / "tiny.toml", "--train.steps=6", f"--checkpoint.resume={path}",
                 f"--checkpoint.dir={tmp_path / 'new-ck'}", f"--train.out_dir={tmp_path / 'new-out'}", *extra)


def test_intact_checkpoint_verifies(base):
    p = cli("verify", str(base / "ck"))
    assert p.returncode == 0 and "step_00000002" in p.stdout, p.stdout + p.stderr
    p = cli("inspect", str(base / "ck" / "step_00000001"))
    assert p.returncode == 0 and "tp00-pp00-dp00" in p.stdout and "step 1" in p.stdout, p.stdout + p.stderr


def test_flipped_byte_is_caught_by_verify_and_resume(tmp_path, base, damaged):
    f = damaged / MODEL
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x40  # inside the tensor data, not the header: the file still parses
    f.write_bytes(bytes(data))
    p = cli("verify", str(damaged))
    assert p.returncode == 1, p.stdout + p.stderr
    problems = p.stdout.strip().splitlines()
    assert problems and all(MODEL in line for line in problems), problems
    assert OPTIM not in p.stdout
    line = one_line_error(_resume(base, damaged, tmp_path))
    assert MODEL in line and "checksum" in line, line
    assert not (tmp_path / "new-out" / "metrics.jsonl").exists()


@pytest.mark.parametrize("victim", [MODEL, OPTIM])
def test_truncated_file_is_caught_by_verify_and_resume(tmp_path, base, damaged, victim):
    f = damaged / victim
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    rc, text = verify_cli(damaged.parent)  # the root: the step `latest` names
    assert rc == 1 and victim in text, text
    other = OPTIM if victim == MODEL else MODEL
    assert other not in text
    line = one_line_error(_resume(base, damaged.parent, tmp_path))
    assert victim in line, line
    assert not (tmp_path / "new-out" / "metrics.jsonl").exists()


def test_resume_auto_falls_back_loudly_past_a_corrupt_latest(tmp_path, base):
    root = tmp_path / "ck"
    shutil.copytree(base / "ck", root)
    f = root / "step_00000002" / OPTIM
    f.write_bytes(f.read_bytes()[:-10])
    p = ok(train(base / "tiny.toml", "--train.steps=6", "--train.stop_at_step=3", "--checkpoint.resume=auto",
                 f"--checkpoint.dir={root}", f"--train.out_dir={tmp_path / 'out'}"))
    assert f"resumed from {root / 'step_00000001'} at step 1" in p.stdout, p.stdout
    warnings = [line for line in p.stdout.splitlines() if "WARNING" in line]
    assert warnings and any("step_00000002" in w and OPTIM in w for w in warnings), p.stdout
    got = losses(tmp_path / "out")
    assert [s for s, _ in got] == [2, 3] and got[0] == losses(base / "out")[1]  # step 2 redone, exactly


def test_missing_coordinate_folder_is_caught(tmp_path, base, damaged):
    shutil.rmtree(damaged / "tp00-pp00-dp00")
    rc, text = verify_cli(damaged)
    assert rc == 1 and "tp00-pp00-dp00" in text, text
    line = one_line_error(_resume(base, damaged, tmp_path))
    assert "tp00-pp00-dp00" in line, line


def test_different_model_config_is_refused_naming_each_field(tmp_path, base):
    line = one_line_error(_resume(base, base / "ck", tmp_path, "--model.n_layer=2", "--model.n_embd=64"))
    assert re.search(r"n_layer\D+4\D+2\b", line), line  # the checkpoint's value, then this run's
    assert re.search(r"n_embd\D+32\D+64\b", line), line
    for same in ("n_head", "block_size", "vocab_size"):
        assert same not in line, line
    assert not (tmp_path / "new-out" / "metrics.jsonl").exists()


def test_newer_format_version_is_refused_naming_both(tmp_path, base, damaged):
    path = damaged / "manifest.json"
    man = json.loads(path.read_text())
    assert man["format_version"] == FORMAT_VERSION
    man["format_version"] = 99
    path.write_text(json.dumps(man))
    line = one_line_error(_resume(base, damaged, tmp_path))
    assert "99" in line and re.search(rf"version\D{{0,3}}{FORMAT_VERSION}\b", line), line
    rc, text = verify_cli(damaged)
    assert rc == 1 and "99" in text, text


# ---------------------------------------------------------------- keep_last and stale folders
def test_keep_last_leaves_the_last_two(tmp_path, token_file):
    cfg = CKPT.toml(tmp_path / "tiny.toml", token_file)
    root = tmp_path / "ck"
    p = ok(train(cfg, "--train.steps=5", f"--checkpoint.dir={root}", "--checkpoint.interval=1",
                 "--checkpoint.keep_last=2", f"--train.out_dir={tmp_path / 'out'}"))
    assert p.stdout.count("checkpoint: saved") == 5
    assert step_names(root) == ["step_00000004", "step_00000005"]
    assert read_latest(root) == "step_00000005"
    assert tmp_dirs(root) == []
    for s in step_names(root):
        assert verify_cli(root / s)[0] == 0
    # keep_last=1 on a resumed run keeps exactly the newest, which `latest` names
    ok(train(cfg, "--train.steps=6", f"--checkpoint.dir={root}", "--checkpoint.keep_last=1",
             "--checkpoint.resume=auto", f"--train.out_dir={tmp_path / 'out'}"))
    assert step_names(root) == ["step_00000006"] and read_latest(root) == "step_00000006"


def test_keep_last_after_rolling_back_keeps_this_runs_checkpoints(tmp_path, token_file):
    cfg = CKPT.toml(tmp_path / "tiny.toml", token_file)
    root = tmp_path / "ck"
    ok(train(cfg, "--train.steps=4", f"--checkpoint.dir={root}", "--checkpoint.interval=1",
             f"--train.out_dir={tmp_path / 'out'}"))
    ok(train(cfg, "--train.steps=4", "--train.stop_at_step=2", f"--checkpoint.dir={root}", "--checkpoint.interval=1",
             "--checkpoint.keep_last=2", f"--checkpoint.resume={root / 'step_00000001'}",
             f"--train.out_dir={tmp_path / 'out'}"))
    assert read_latest(root) == "step_00000002"
    # the two newest checkpoints of the rolled-back run are step 1 (resumed from) and step 2
    assert "step_00000001" in step_names(root), step_names(root)


def test_stale_tmp_folder_is_removed_by_the_next_save(tmp_path, base):
    root = tmp_path / "ck"
    copy_step(base / "ck" / "step_00000002", root)
    for stale in (".tmp-step_00000003", ".tmp-step_00000099", ".tmp-old-step_00000002"):
        (root / stale / "tp00-pp00-dp00").mkdir(parents=True)
        (root / stale / "tp00-pp00-dp00" / "model.safetensors").write_bytes(b"half a file")
    p = ok(train(base / "tiny.toml", "--train.steps=6", "--train.stop_at_step=3", f"--checkpoint.dir={root}",
                 "--checkpoint.resume=auto", f"--train.out_dir={tmp_path / 'out'}"))
    assert "at step 2" in p.stdout
    assert tmp_dirs(root) == []
    assert step_names(root) == ["step_00000002", "step_00000003"] and read_latest(root) == "step_00000003"
    assert verify_cli(root)[0] == 0


# ---------------------------------------------------------------- processes killed and preempted
def test_sigkill_of_a_rank_during_a_save(tmp_path, token_file):
    cfg = CKPT.toml(tmp_path / "tiny.toml", token_file)
    root = tmp_path / "ck"
    args = ["--parallel.tp=2", "--parallel.dp=2", "--train.steps=400", f"--checkpoint.dir={root}",
            "--checkpoint.interval=1", "--checkpoint.keep_last=3", f"--train.out_dir={tmp_path / 'out'}"]
    seed = 20261130  # fixed: the same kill timing each run (as far as the scheduler allows)
    rng = random.Random(seed)
    proc = popen_train(cfg, *args, nproc=4)
    try:
        assert wait_for(lambda: (root / "latest").exists(), 150, 0.05), "no checkpoint was ever committed"
        time.sleep(rng.uniform(0, 0.5))
        workers = children(proc.pid)
        assert len(workers) == 4, workers
        victim = rng.choice(workers)
        # kill inside a save (saves every step): the moment its temporary folder is seen
        in_save = wait_for(lambda: any(root.glob(".tmp-step_*")), 10, 0.0005)
        os.kill(victim, signal.SIGKILL)
        out, _ = proc.communicate(timeout=150)
    finally:
        kill_tree(proc)
    note = f"(seed {seed}, killed pid {victim}, during a save: {in_save}, tmp left: {tmp_dirs(root)})"
    print(note)
    assert in_save, "the kill did not land inside a save " + note
    assert proc.returncode != 0, note + out[-3000:]
    latest = read_latest(root)
    assert latest and (root / latest / "manifest.json").is_file(), note
    assert committed_steps(root) == [int(s[5:]) for s in step_names(root)], note  # no half-committed step
    rc, text = verify_cli(root)
    assert rc == 0, note + text
    k = int(latest[5:])
    # a fresh launch resumes from it, removes any stale temporary folder, and completes
    p = ok(train(cfg, *args, "--checkpoint.resume=auto", f"--train.stop_at_step={k + 1}", nproc=4))
    assert f"resumed from {root / latest} at step {k} (same layout)" in p.stdout, note
    assert read_latest(root) == f"step_{k + 1:08d}" and tmp_dirs(root) == [], note
    assert verify_cli(root)[0] == 0, note
    assert [r["step"] for r in metrics(tmp_path / "out")][-1] == k + 1


def test_sigterm_to_every_worker_saves_and_exits_cleanly(tmp_path, token_file):
    """What a scheduler's preemption does: SIGTERM to every process of the job (here 2 pipeline stages,
    with async saves); the ranks agree on a step, save it, and exit 0."""
    cfg = CKPT.toml(tmp_path / "tiny.toml", token_file)
    root, out = tmp_path / "ck", tmp_path / "out"
    proc = popen_train(cfg, "--parallel.pp=2", "--train.steps=400", f"--checkpoint.dir={root}",
                       "--checkpoint.async=true", f"--train.out_dir={out}", nproc=2)
    try:
        assert wait_for(lambda: (out / "metrics.jsonl").exists() and len(metrics(out)) >= 2, 150, 0.05)
        for pid in children(proc.pid):
            os.kill(pid, signal.SIGTERM)
        text, _ = proc.communicate(timeout=150)
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, text[-3000:]
    m = re.search(r"stopped by SIGTERM at step (\d+)/400", text)
    assert m, text[-3000:]
    k = int(m[1])
    assert 2 <= k < 400
    assert read_latest(root) == f"step_{k:08d}" and step_names(root) == [f"step_{k:08d}"]
    assert [r["step"] for r in metrics(out)][-1] == k
    rc, text = verify_cli(root)
    assert rc == 0, text


# ---------------------------------------------------------------- a rank that cannot write
def _failing_writer(rank, world_size, tmp_dir, tokens):
    import torch
    import torch.distributed as dist
    from megalite.checkpoint import AsyncSaver, CheckpointError, save_checkpoint
    from megalite.checkpoint import commit as save_mod
    from megalite.checkpoint.verify import verify
    from megalite.parallel.grid import Layout, ParallelGrid
    from megalite.run.train import build, train_step

    grid = ParallelGrid.create(Layout(1, 1, 2))
    tr = build(CKPT.config(tokens, **{"parallel.dp": 2}), grid, torch.device("cpu"))
    root = Path(tmp_dir) / "ck"
    train_step(tr)
    assert save_checkpoint(root, 1, tr.model, tr.optimizer, grid) == root / "step_00000001"
    train_step(tr)
    real = save_mod.write_rank

    def failing(folder, pay, rel, *more):
        if rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(folder, pay, rel, *more)

    save_mod.write_rank = failing
    try:
        with pytest.raises(CheckpointError) as e:
            save_checkpoint(root, 2, tr.model, tr.optimizer, grid)
        msg = str(e.value)
        same_on_every_rank(msg, world_size)
        assert "\n" not in msg and "step 2" in msg and "rank 1" in msg and "No space left" in msg, msg
        assert_still_at_step_1(root)
        saver = AsyncSaver()  # the same failure from a background save surfaces at wait()
        assert save_checkpoint(root, 2, tr.model, tr.optimizer, grid, saver=saver) is None
        with pytest.raises(CheckpointError) as e:
            saver.wait()
        same_on_every_rank(str(e.value), world_size)
        assert "rank 1" in str(e.value)
        assert_still_at_step_1(root)
    finally:
        save_mod.write_rank = real
    assert save_checkpoint(root, 2, tr.model, tr.optimizer, grid) == root / "step_00000002"  # disk is back
    dist.barrier()
    assert read_latest(root) == "step_00000002" and verify(root)[1] == []


def test_a_rank_that_cannot_write_fails_the_save_everywhere(tmp_path, token_file):
    run_parallel(_failing_writer, 2, tmp_path, args=(str(token_file),))
