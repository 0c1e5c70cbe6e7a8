"""Beyond one machine: two simulated hosts (network namespaces on a bridge, each with its own address), one
torchrun agent per host with the c10d rendezvous at host 0's address, gloo on each host's own interface, and
one shared checkpoint folder, as on a cluster's shared filesystem.

- (2, 2, 2) across the two hosts gives the single-process losses (1e-5);
- losing host 1 (cable out, then SIGKILL of every process on it), once during an async save and once later,
  never leaves host 0's workers waiting past the process-group timeout, `latest` always verifies, and both
  ways torchrun users restart (`--max-restarts` with a replacement agent on host 1; a fresh launch of both)
  continue the uninterrupted run's loss curve bit for bit.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import helpers as H
from benchmarks.simcluster import SimCluster, SimUnavailable

STEPS = 12
TIMEOUT_S = 10  # parallel.timeout_s: how long host 0's collectives wait for a silent host (each loss waits it out)
RUN = H.Tiny(steps=STEPS, global_batch_size=8)
LAYOUT = {"parallel.tp": 2, "parallel.pp": 2, "parallel.dp": 2}


@pytest.fixture(scope="module")
def cluster():
    try:
        c = SimCluster(2).__enter__()
    except SimUnavailable as e:
        pytest.skip(f"no simulated hosts on this machine: {e}")
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def toml(tmp_path_factory, token_file) -> Path:
    return RUN.toml(tmp_path_factory.mktemp("cluster") / "tiny.toml", token_file)


class Agent:
    """One torchrun agent on one simulated host, its output in a log file."""

    def __init__(self, cluster, host, toml, out, ckpt, log: Path, restarts=0, port=29400, rid="sim"):
        args = ["-m", "megalite", "train", "--config", toml, f"--train.out_dir={out}",
                *[f"--{k}={v}" for k, v in LAYOUT.items()], f"--checkpoint.dir={ckpt}", "--checkpoint.interval=1",
                "--checkpoint.async=true", "--checkpoint.resume=auto", f"--parallel.timeout_s={TIMEOUT_S}"]
        self.log = log
        with open(log, "a") as f:
            self.proc = subprocess.Popen(cluster.torchrun(host, args, max_restarts=restarts, rdzv_port=port,
                                                          rdzv_id=rid),
                                         env=H.env(), stdout=f, stderr=subprocess.STDOUT)

    def workers(self) -> set:
        return set(H.children(self.proc.pid))

    def wait(self, timeout=H.TORCHRUN_TIMEOUT) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"torchrun agent still running after {timeout} s:\n{self.output()}") from None

    def output(self) -> str:
        return self.log.read_text()[-4000:]


def _both(cluster, tmp, toml, out, ckpt, **kw) -> list:
    return [Agent(cluster, h, toml, out, ckpt, tmp / f"agent{h.index}.log", **kw) for h in cluster.hosts]


def _all_ok(agents) -> None:
    for a in agents:
        assert a.wait() == 0, a.output()


def _alive(pids) -> set:
    def running(pid):
        try:
            return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
        except OSError:
            return False
    return {p for p in pids if running(p)}


def _lose_host1(cluster, agent0: Agent) -> float:
    """Lose host 1; return how long host 0's workers then lived (they must fail on the timeout, not hang)."""
    workers = agent0.workers()
    assert workers, agent0.output()
    t0 = time.monotonic()
    assert cluster.lose(cluster.hosts[1])
    assert H.wait_for(lambda: not _alive(workers), timeout=TIMEOUT_S + 60, interval=0.1), \
        f"host 0's workers still running {TIMEOUT_S + 60} s after host 1 was lost:\n{agent0.output()}"
    return time.monotonic() - t0


def _verified_latest(ckpt: Path) -> int:
    from megalite.checkpoint.verify import verify
    step, problems = verify(ckpt)
    assert problems == [], problems
    return int(step.name.split("_")[1])


@pytest.fixture(scope="module")
def uninterrupted(cluster, toml, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("two_hosts")
    _all_ok(_both(cluster, tmp, toml, tmp / "run", tmp / "ckpt"))
    return {"metrics": H.metrics(tmp / "run"), "ckpt": tmp / "ckpt"}


def test_two_hosts_match_one_process(cluster, uninterrupted, token_file, tmp_path):
    # the subnet lives only inside the namespaces: this machine's own network has no such address
    assert cluster.hosts[0].addr not in subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout
    ref = [r["loss"] for r in H.train_in_process(RUN.config(token_file, tmp_path / "one")).history]
    got = uninterrupted["metrics"]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got] == pytest.approx(ref, rel=1e-5)
    # one shared checkpoint folder, written by the ranks of both hosts (host 1 holds pipeline stage 1)
    assert _verified_latest(uninterrupted["ckpt"]) == STEPS
    coords = sorted(p.name for p in (uninterrupted["ckpt"] / f"step_{STEPS:08d}").iterdir() if p.is_dir())
    assert coords == [f"tp{t:02d}-pp{p:02d}-dp{d:02d}" for t in range(2) for p in range(2) for d in range(2)]


def _freeze_host1_mid_save(cluster, ckpt: Path, agent0: Agent, timeout: float = 120) -> int:
    """Wait for an async save in flight (its .tmp-step_N folder exists, `latest` names an older step) and
    SIGSTOP host 1 right there; return N once that save stays uncommitted (rank 0 commits only with host
    1's reports). If host 1 had already reported and the commit goes through anyway, resume host 1 and
    try again at the next save."""
    host1 = cluster.hosts[1]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if agent0.proc.poll() is not None:
            break
        tmps = [p.name for p in ckpt.glob(".tmp-step_*")] if ckpt.exists() else []
        if not tmps or not (ckpt / "latest").exists():
            time.sleep(0.0005)
            continue
        pids = host1.pids()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        step = int(tmps[0].rsplit("_", 1)[1])
        if not H.wait_for(lambda: (ckpt / f"step_{step:08d}").exists(), timeout=3, interval=0.05):
            return step
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    raise AssertionError(f"no async save caught in flight:\n{agent0.output()}")


@pytest.mark.slow  # rare and long (~60 s: three 4-process launches on two simulated hosts, each loss waits out
# timeout_s); the default run keeps test_two_hosts_match_one_process (two hosts) and test_faults' restart + resume
def test_losing_a_host_then_restarting(cluster, uninterrupted, toml, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "run"
    host1 = cluster.hosts[1]
    # 1. host 1 vanishes in the middle of an async save; host 0's agent restarts its workers
    #    (--max-restarts=1) and a replacement agent starts on host 1
    a0, a1 = _both(cluster, tmp_path, toml, out, ckpt, restarts=1)
    in_flight = _freeze_host1_mid_save(cluster, ckpt, a0)
    committed = _verified_latest(ckpt)
    assert committed < in_flight
    waited = _lose_host1(cluster, a0)
    assert waited < TIMEOUT_S + 30, f"host 0's workers lived {waited:.0f} s after the loss"
    assert a1.proc.wait(timeout=30) == -signal.SIGKILL
    assert _verified_latest(ckpt) == committed  # the save in flight never became `latest`
    cluster.plug(host1)
    a1 = Agent(cluster, host1, toml, out, ckpt, tmp_path / "agent1-replacement.log", restarts=1)
    # 2. once the restarted job has committed a checkpoint of its own, lose host 1 again: host 0's agent has
    #    no restarts left and fails; then a fresh launch of both hosts, as after a whole-job failure
    assert H.wait_for(lambda: _step_of_latest(ckpt) > committed, timeout=H.TORCHRUN_TIMEOUT, interval=0.01), \
        a0.output() + a1.output()
    waited2 = _lose_host1(cluster, a0)
    assert waited2 < TIMEOUT_S + 30, f"host 0's workers lived {waited2:.0f} s after the second loss"
    assert a0.wait(timeout=60) != 0
    resumed_from = _verified_latest(ckpt)
    assert committed < resumed_from < STEPS
    cluster.plug(host1)
    _all_ok(_both(cluster, tmp_path, toml, out, ckpt, port=29401, rid="sim-again"))
    logs = "".join(p.read_text() for p in tmp_path.glob("agent*.log"))
    assert f"resumed from {ckpt / f'step_{committed:08d}'} at step {committed}" in logs
    assert f"resumed from {ckpt / f'step_{resumed_from:08d}'} at step {resumed_from}" in logs
    # the curve from every resume on is the uninterrupted run's, bit for bit; latest verifies
    got = [(r["step"], r["loss"], r["grad_norm"]) for r in H.metrics(out)]
    ref = [(r["step"], r["loss"], r["grad_norm"]) for r in uninterrupted["metrics"]]
    assert got == ref
    assert _verified_latest(ckpt) == STEPS


def _step_of_latest(ckpt: Path) -> int:
    try:
        return int((ckpt / "latest").read_text().strip().rsplit("_", 1)[1])
    except (OSError, ValueError, IndexError):
        return -1
