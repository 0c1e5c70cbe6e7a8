"""End to end through the real launcher: torchrun (one node and two nodes on loopback) runs
`python -m megalite train`, and the loss curve equals a plain one-process run of the same command."""
import shutil
import socket
import subprocess
import sys

import pytest

from helpers import env, metrics, ok, run

STEPS = 4
METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s"}
TORCHRUN = [shutil.which("torchrun") or sys.executable, *([] if shutil.which("torchrun") else
                                                          ["-m", "torch.distributed.run"])]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_args(toml, out_dir, *extra):
    return ["-m", "megalite", "train", "--config", str(toml), f"--train.out_dir={out_dir}",
            f"--train.steps={STEPS}", *extra]


def _metrics(out_dir):
    recs = metrics(out_dir)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    for r in recs:
        assert METRIC_KEYS <= r.keys(), r.keys()
        assert r["tokens_per_s"] > 0 and r["lr"] > 0 and r["grad_norm"] > 0
    return recs


def _check_progress(stdout):
    progress = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert progress, stdout
    for line in progress:
        assert all(word in line for word in ("step", "loss", "tok/s", "ETA")), line
    assert len(progress) == len(set(progress))  # printed by rank 0 only, not once per rank
    assert f"{STEPS}/{STEPS}" in progress[-1]


def _same_curve(recs, ref):
    assert [r["loss"] for r in recs] == pytest.approx([r["loss"] for r in ref], rel=1e-5)
    assert [r["lr"] for r in recs] == pytest.approx([r["lr"] for r in ref], rel=1e-12)


@pytest.fixture
def single_process_run(tmp_path, tiny_toml):
    out = tmp_path / "single"
    r = ok(run([sys.executable, *_train_args(tiny_toml, out)], cwd=tmp_path, timeout=300))
    _check_progress(r.stdout)
    return _metrics(out)


def test_torchrun_8_processes_3d(tmp_path, tiny_toml, single_process_run):
    out = tmp_path / "r8"
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "8",
           *_train_args(tiny_toml, out, "--parallel.tp=2", "--parallel.pp=2", "--parallel.dp=2")]
    r = ok(run(cmd, cwd=tmp_path, timeout=300))
    assert "tp=2 pp=2 dp=2 on 8" in r.stdout
    _check_progress(r.stdout)
    _same_curve(_metrics(out), single_process_run)


def test_torchrun_two_nodes_on_loopback(tmp_path, tiny_toml, single_process_run):
    out = tmp_path / "r4"
    port = _free_port()
    procs = []
    for node in range(2):
        cmd = [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"megalite-test-{port}",
               "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}", "--local-addr", "127.0.0.1",
               *_train_args(tiny_toml, out, "--parallel.tp=2", "--parallel.dp=0")]  # dp = 4 / 2, inferred
        procs.append(subprocess.Popen(cmd, env=env(), cwd=tmp_path, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=300)
            results.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for code, stdout, stderr in results:
        assert code == 0, stdout[-3000:] + stderr[-3000:]
    stdout = "".join(s for _, s, _ in results)
    assert "tp=2 pp=1 dp=2 on 4" in stdout
    _check_progress(stdout)
    _same_curve(_metrics(out), single_process_run)
