"""Fault injection end to end: a rank dying mid-run under torchrun, the disk filling up in the middle of a
save, a checkpoint folder that cannot be written, two runs fighting over one folder, a dangling `latest`,
and `python -m benchmarks stress ckpt`. Whatever happens, `latest` names a whole checkpoint and resuming from it
reproduces the uninterrupted loss curve exactly."""
from __future__ import annotations

import errno
import os
import shlex
import shutil
import signal
import sys
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from helpers import (CKPT, MEGALITE, TIMEOUT, assert_still_at_step_1, env, metrics, metrics_lines, ok, one_line_error,
                     same_on_every_rank, step_names, tmp_dirs, torchrun_cmd, train, train_cmd, train_in_process,
                     verify_cli, wait_for)
from megalite.checkpoint.tree import committed_steps, read_latest
from megalite.testing import run_parallel

SMALL = {"n_layer": 2, "dropout": 0.1}  # dropout: a resume must restore the RNG streams to be exact
CRASH_TIMEOUT = 90  # crash + restart take ~25 s; with the restart bug below the new workers can hang instead
# the metrics a resumed run must reproduce bit for bit (timings excluded)
EXACT = ("step", "loss", "lr", "grad_norm", "tokens_seen", "val_loss", "batch_hash")


def _exact(records: list) -> list:
    return [{k: r[k] for k in EXACT if k in r} for r in records]


def _kill_launch(tag: str) -> None:
    """SIGKILL every process of one launch, found by the tag in its environment: torchrun starts each
    worker in a session of its own, so killing torchrun's process group can leave workers behind."""
    mark = f"MEGALITE_TEST_LAUNCH={tag}".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if mark in (d / "environ").read_bytes().split(b"\0"):
                os.kill(int(d.name), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def _run(cmd: list, extra_env: dict | None = None, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """Run a launch with its output in files (a stuck worker holding a pipe cannot block us); on timeout,
    or if anything of it outlives the launcher, kill all of it. returncode None means it timed out."""
    tag = uuid.uuid4().hex
    with tempfile.TemporaryDirectory() as d:
        out, err = Path(d) / "out", Path(d) / "err"
        with open(out, "w") as fo, open(err, "w") as fe:
            proc = subprocess.Popen(cmd, env=env({**(extra_env or {}), "MEGALITE_TEST_LAUNCH": tag}),
                                    stdout=fo, stderr=fe, text=True, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        _kill_launch(tag)
        proc.wait(timeout=30)
        text_out, text_err = out.read_text(errors="replace"), err.read_text(errors="replace")
    if code is None:
        text_err += f"\n[test] timed out after {timeout}s: {' '.join(map(str, cmd))}"
    return subprocess.CompletedProcess(cmd, code, text_out, text_err)


def _nothing_trained(p: subprocess.CompletedProcess, out_dir: Path) -> None:
    assert not (out_dir / "metrics.jsonl").exists()
    assert "step " not in p.stdout and "| loss" not in p.stdout, p.stdout


# ---------------------------------------------------------------- 1. a rank crashes under torchrun
TP2DP2 = ["--parallel.tp=2", "--parallel.dp=2", "--train.steps=8"]


@pytest.fixture(scope="module")
def crash_job(tmp_path_factory, token_file):
    """torchrun --max-restarts=1 of a tp=2 dp=2 run (a checkpoint every 2 steps) whose rank 1 dies hard
    after step 5, once. Never fails itself: the tests judge the outcome."""
    d = tmp_path_factory.mktemp("crash")
    cfg = CKPT.toml(d / "tiny.toml", token_file, model=SMALL)
    args = ["--config", cfg, *TP2DP2, f"--checkpoint.dir={d / 'ck'}", "--checkpoint.interval=2",
            "--checkpoint.resume=auto", f"--train.out_dir={d / 'out'}"]
    crash_env = {"MEGALITE_CRASH_AT_STEP": "5", "MEGALITE_CRASH_RANK": "1",
                 "MEGALITE_CRASH_ONCE": str(d / "crashed-once")}
    job = _run(torchrun_cmd(4, "train", *args, restarts=1), crash_env, timeout=CRASH_TIMEOUT)
    after_job = metrics(d / "out") if (d / "out" / "metrics.jsonl").exists() else []
    return {"dir": d, "cfg": cfg, "args": args, "env": crash_env, "job": job, "after_job": after_job}


@pytest.fixture(scope="module")
def reference(crash_job):
    """An uninterrupted run of the same config and layout: the loss curve to reproduce exactly."""
    d = crash_job["dir"]
    ok(_run(torchrun_cmd(4, "train", "--config", crash_job["cfg"], *TP2DP2, f"--train.out_dir={d / 'ref'}")))
    return _exact(metrics(d / "ref"))


def _assert_resumed_exactly(text: str, d: Path, reference: list) -> None:
    assert f"resumed from {d / 'ck' / 'step_00000004'} at step 4 (same layout)" in text, text[-3000:]
    got = metrics(d / "out")
    assert [r["step"] for r in got] == list(range(1, 9))
    lines = metrics_lines(d / "out")  # appended, never truncated: the resume is an event line in the file
    assert {"event": "resume", "step": 4, "layout": "tp=2 pp=1 dp=2", "from": str(d / "ck" / "step_00000004")} \
        in lines, lines
    assert [r["step"] for r in lines if "event" not in r][:4] == [1, 2, 3, 4]
    assert _exact(got) == reference  # bit-exact, the steps redone after the crash included
    assert read_latest(d / "ck") == "step_00000008" and verify_cli(d / "ck")[0] == 0


def test_rank_crash_under_torchrun_restarts_and_resumes_exactly(crash_job, reference):
    job, d = crash_job["job"], crash_job["dir"]
    text = job.stdout + job.stderr
    assert "injected crash at step 5 on rank 1" in text
    assert job.returncode == 0, f"exit {job.returncode}\n{text[-4000:]}"
    _assert_resumed_exactly(text, d, reference)


def test_rank_crash_then_relaunch_resumes_exactly(crash_job, reference):
    """What torchrun's restart does, by hand: the crash left `latest` at step 4 (steps 5.. possibly in
    metrics.jsonl); a new launch with resume=auto keeps lines 1-4, redoes 5-8 and matches the reference."""
    d, job = crash_job["dir"], crash_job["job"]
    assert (d / "crashed-once").read_text().startswith("crashed at step 5 on rank 1")
    assert committed_steps(d / "ck")[-1] >= 4 and tmp_dirs(d / "ck") == []
    assert verify_cli(d / "ck")[0] == 0
    before = crash_job["after_job"]
    if job.returncode == 0:  # torchrun's own restart worked: nothing left to do by hand
        text = job.stdout
    else:
        assert read_latest(d / "ck") == "step_00000004", job.stdout[-2000:]
        assert [r["step"] for r in before][:4] == [1, 2, 3, 4] and _exact(before[:4]) == reference[:4]
        p = ok(_run(torchrun_cmd(4, "train", *crash_job["args"]), crash_job["env"]))  # the marker: no second crash
        text = p.stdout
    _assert_resumed_exactly(text, d, reference)


# ---------------------------------------------------------------- 2. the disk fills up mid-save
def _full_disk_worker(rank, world_size, tmp_dir, tokens):
    import builtins
    import contextlib

    import torch
    import torch.distributed as dist
    from megalite.checkpoint import CheckpointError, save_checkpoint
    from megalite.run.ckpt_policy import CheckpointManager
    from megalite.checkpoint.verify import verify
    from megalite.parallel.grid import Layout, ParallelGrid
    from megalite.run.train import build, train_step

    root = Path(tmp_dir) / "ck"
    cfg = CKPT.config(tokens, **{"parallel.dp": 2, "model.n_layer": 2, "checkpoint.dir": str(root)})
    grid = ParallelGrid.create(Layout(1, 1, 2))
    tr = build(cfg, grid, torch.device("cpu"))
    train_step(tr)
    assert save_checkpoint(root, 1, tr.model, tr.optimizer, grid, config=cfg.to_dict()) == root / "step_00000001"
    train_step(tr)
    real_open = builtins.open

    class HalfWritten:
        """A file on a disk that fills up: the first write stores half its bytes, then ENOSPC."""

        def __init__(self, f):
            self._f = f

        def write(self, data):
            data = bytes(memoryview(data).cast("B"))
            self._f.write(data[: len(data) // 2])
            self._f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    @contextlib.contextmanager
    def disk_full_on(victim):
        """The disk fills up while rank `victim` writes its second file of the save (whatever writes it:
        every file a save writes is opened with open() under root/.tmp-step_N/)."""
        n = [0]

        def fake_open(file, mode="r", *args, **kwargs):
            f = real_open(file, mode, *args, **kwargs)
            if rank == victim and "w" in mode and isinstance(file, (str, os.PathLike)) \
                    and Path(file).is_relative_to(root) \
                    and Path(file).relative_to(root).parts[0].startswith(".tmp-step_"):
                n[0] += 1
                if n[0] == 2:
                    return HalfWritten(f)
            return f

        builtins.open = fake_open
        try:
            yield
        finally:
            builtins.open = real_open
            assert rank != victim or n[0] >= 2, "the save wrote fewer than two files: nothing was injected"

    # the API: every rank raises the same one-line error, whichever rank ran out of space
    for victim in (1, 0):
        with disk_full_on(victim), pytest.raises(CheckpointError) as e:
            save_checkpoint(root, 2, tr.model, tr.optimizer, grid, config=cfg.to_dict())
        msg = str(e.value)
        same_on_every_rank(msg, world_size)
        assert "\n" not in msg and "No space left" in msg and "step 2" in msg and f"rank {victim}" in msg, msg
        assert "step_00000001" in msg, msg  # says what `latest` still names
        assert_still_at_step_1(root)

    # the training loop's manager: on_error=stop raises, on_error=continue warns (rank 0) and trains on
    with disk_full_on(1), pytest.raises(CheckpointError, match="No space left"):
        CheckpointManager(cfg, grid, log=lambda *a: None).save(tr)
    assert_still_at_step_1(root)
    cfg.checkpoint.on_error = "continue"
    for async_ in (False, True):
        cfg.checkpoint.async_ = async_
        logs = []
        mgr = CheckpointManager(cfg, grid, log=logs.append)
        with disk_full_on(1):
            mgr.save(tr)
            mgr.wait()
        warnings = [line for line in logs if "WARNING" in line]
        if rank == 0:
            assert len(warnings) == 1 and "No space left" in warnings[0] and "continue" in warnings[0], logs
            assert not any(line.startswith("checkpoint: saved") for line in logs), logs
        else:
            assert logs == []  # only rank 0 logs
        assert_still_at_step_1(root)
    # space again: the next save commits
    cfg.checkpoint.async_ = False
    mgr = CheckpointManager(cfg, grid, log=lambda *a: None)
    mgr.save(tr)
    dist.barrier()
    assert read_latest(root) == "step_00000002" and verify(root)[1] == [] and tmp_dirs(root) == []


def test_disk_full_mid_save_fails_everywhere_and_keeps_latest(tmp_path, token_file):
    run_parallel(_full_disk_worker, 2, tmp_path, args=(str(token_file),))


@pytest.fixture
def small_disk(tmp_path):
    """A 760 KiB tmpfs: one checkpoint of the n_layer=2 model (~475 KiB) fits, a second does not."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=760k", "tmpfs", str(mnt)], capture_output=True,
                       text=True, timeout=30)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in this sandbox: {p.stderr.strip() or p.returncode}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def test_real_full_disk_stops_training_with_latest_intact(tmp_path, token_file, small_disk):
    cfg = CKPT.toml(tmp_path / "tiny.toml", token_file, model=SMALL)
    root, out = small_disk / "ck", tmp_path / "out"
    p = train(cfg, "--train.steps=4", "--checkpoint.interval=2", f"--checkpoint.dir={root}",
              f"--train.out_dir={out}")
    line = one_line_error(p, "megalite train: error:")
    assert "No space left" in line and "step 4" in line and "step_00000002" in line, line
    assert "checkpoint: saved" in p.stdout and p.stdout.count("checkpoint: saved") == 1, p.stdout
    assert read_latest(root) == "step_00000002" and step_names(root) == ["step_00000002"]
    assert tmp_dirs(root) == []
    rc, text = verify_cli(root)
    assert rc == 0, text
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]


# ---------------------------------------------------------------- 3. a checkpoint folder that cannot be written
def test_checkpoint_dir_under_a_regular_file_fails_before_training(tmp_path, token_file):
    cfg = CKPT.toml(tmp_path / "tiny.toml", token_file, model=SMALL)
    (tmp_path / "a-file").write_text("not a folder")
    ck, out = tmp_path / "a-file" / "ck", tmp_path / "out"
    p = train(cfg, f"--checkpoint.dir={ck}", f"--train.out_dir={out}")
    line = one_line_error(p, "megalite train: error:")
    assert "checkpoint.dir" in line and str(ck) in line and "Not a directory" in line, line
    _nothing_trained(p, out)
    assert not out.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits")
def test_read_only_checkpoint_dir_fails_before_training(tmp_path, token_file):
    cfg = CKPT.toml(tmp_path / "tiny.toml", token_file, model=SMALL)
    ro, out = tmp_path / "read-only", tmp_path / "out"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        p = train(cfg, f"--checkpoint.dir={ro / 'ck'}", f"--train.out_dir={out}")
    finally:
        ro.chmod(0o755)
    line = one_line_error(p, "megalite train: error:")
    assert "checkpoint.dir" in line and str(ro / "ck") in line, line
    _nothing_trained(p, out)


# ---------------------------------------------------------------- 4. two runs on one checkpoint folder
def _popen_logged(cmd: list, log: Path) -> subprocess.Popen:
    f = open(log, "w")
    try:
        return subprocess.Popen(cmd, env=env(), stdout=f, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    finally:
        f.close()


def _started(proc: subprocess.Popen, log: Path, lock: Path) -> bool:
    """The run holds the lock and has printed its first step."""
    return wait_for(lambda: proc.poll() is not None or (lock.exists() and "| loss" in log.read_text()),
                    TIMEOUT, 0.05) and proc.poll() is None


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def test_second_run_on_the_same_checkpoint_dir_is_refused(tmp_path, token_file):
    cfg = CKPT.toml(tmp_path / "tiny.toml", token_file, model=SMALL)
    ck = tmp_path / "ck"
    lock = ck / "lock"
    long_run = ["--train.steps=1000000", f"--checkpoint.dir={ck}"]
    log_a = tmp_path / "a.log"
    a = _popen_logged(train_cmd(cfg, *long_run, f"--train.out_dir={tmp_path / 'out-a'}"), log_a)
    try:
        assert _started(a, log_a, lock), log_a.read_text()[-3000:]
        # a second run on the same folder: refused before it trains, naming the lock
        b = train(cfg, f"--checkpoint.dir={ck}", f"--train.out_dir={tmp_path / 'out-b'}")
        line = one_line_error(b, "megalite train: error:")
        assert "in use" in line and str(lock) in line and f"pid {a.pid}" in line, line
        _nothing_trained(b, tmp_path / "out-b")
        assert a.poll() is None, "the first run must not notice"
        a.send_signal(signal.SIGTERM)  # let it finish: save and exit cleanly
        a.wait(timeout=TIMEOUT)
    finally:
        _kill(a)
    text = log_a.read_text()
    assert a.returncode == 0, text[-3000:]
    k = int(text.split("stopped by SIGTERM at step ")[1].split("/")[0])
    assert [r["step"] for r in metrics(tmp_path / "out-a")] == list(range(1, k + 1))
    assert read_latest(ck) == f"step_{k:08d}" and verify_cli(ck)[0] == 0

    # a run killed with SIGKILL while holding the lock does not leave it stuck
    log_c = tmp_path / "c.log"
    c = _popen_logged(train_cmd(cfg, *long_run, "--checkpoint.resume=auto",
                                f"--train.out_dir={tmp_path / 'out-c'}"), log_c)
    try:
        assert _started(c, log_c, lock), log_c.read_text()[-3000:]
        assert f"pid {c.pid}" in lock.read_text()
    finally:
        os.killpg(c.pid, signal.SIGKILL)
        c.wait(timeout=30)
    assert c.returncode == -signal.SIGKILL
    d = ok(train(cfg, *long_run, "--checkpoint.resume=auto", f"--train.stop_at_step={k + 1}",
                 f"--train.out_dir={tmp_path / 'out-d'}"))
    assert f"at step {k} (same layout)" in d.stdout, d.stdout
    assert read_latest(ck) == f"step_{k + 1:08d}" and verify_cli(ck)[0] == 0


# ---------------------------------------------------------------- 5. `latest` names a folder that is gone
def test_resume_auto_falls_back_loudly_when_latest_names_a_missing_folder(tmp_path, token_file):
    """(test_checkpoint_faults covers a corrupt `latest` step, test_checkpoint_resume a dangling `latest`
    with nothing to fall back to; this is the dangling `latest` with older steps present.) In-process."""
    root = tmp_path / "ck"

    def run(steps, **kw):
        cfg = CKPT.config(token_file, **{"model.n_layer": 2, "model.dropout": 0.1, "train.steps": steps,
                                         "checkpoint.dir": str(root), **kw})
        logs = []
        return train_in_process(cfg, log=logs.append), logs

    base, _ = run(3, **{"checkpoint.interval": 1, "train.out_dir": str(tmp_path / "base")})
    assert step_names(root) == ["step_00000001", "step_00000002", "step_00000003"]
    shutil.rmtree(root / "step_00000003")
    assert read_latest(root) == "step_00000003"
    tr, logs = run(3, **{"checkpoint.resume": "auto", "train.out_dir": str(tmp_path / "resumed")})
    warnings = [line for line in logs if line.startswith("WARNING")]
    assert any("step_00000003" in w and "does not exist" in w for w in warnings), logs
    assert any(f"falling back to {root / 'step_00000002'}" in w for w in warnings), logs
    assert any(f"resumed from {root / 'step_00000002'} at step 2" in line for line in logs), logs
    assert _exact(tr.history) == _exact(base.history[2:])  # step 3 redone exactly
    assert read_latest(root) == "step_00000003" and verify_cli(root)[0] == 0


# ---------------------------------------------------------------- 6. python -m benchmarks stress ckpt
@pytest.mark.slow  # three 4-process launches (~45 s); the protocol's every step is covered by test_kill_points
def test_stress_ckpt_one_trial(tmp_path, token_file):
    work = tmp_path / "stress"
    work.mkdir()
    shutil.copy(token_file, work / "tokens.bin")  # skip building the default corpus
    shutil.copy(Path(token_file).with_suffix(".json"), work / "tokens.json")
    from benchmarks import transcripts
    runs = []  # docs/reliability.md's `python -m benchmarks stress ckpt --trials 10`, small: --trials 1 --steps 8 ...
    root = str(Path(__file__).resolve().parents[1])  # a checkout's root: where `python -m benchmarks` is found

    def runner(cmd):
        pythonpath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        runs.append(ok(_run([sys.executable, *shlex.split(cmd)[1:], "--workdir", str(work)],
                            extra_env={"PYTHONPATH": pythonpath}, timeout=300)))
        return runs[-1].stdout

    shown = transcripts.check("stress", runner)
    (p,) = runs
    assert "--trials 1 --steps 8 --seed 11 --width 32" in transcripts.small_command("stress", "--trials 10")
    lines = p.stdout.strip().splitlines()
    assert lines[-2].split() == ["trials", "valid", "latest", "resumed", "exactly", "killed", "mid-save",
                                 "data", "lost"], p.stdout
    trials, valid, exact, mid_save, lost = map(int, lines[-1].split())
    assert trials == valid == exact == 1 and lost == 0, p.stdout
    assert mid_save == 1, "the kill did not land inside a save:\n" + p.stdout
    assert shown == [], "docs/reliability.md shows lines the harness no longer prints"
