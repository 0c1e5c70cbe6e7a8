"""`python -m benchmarks stress ckpt`: kill a random rank mid-save, N times, and check that nothing is lost.

Each trial launches a real `torchrun` (4 gloo ranks, a save every step) and SIGKILLs one worker at a random
moment inside a save; `latest` must then verify and a resume must continue the uninterrupted run's losses
exactly. The deterministic twin, one kill at each step of the commit protocol, is tests/test_kill_points.py
(the points are megalite.base.faults.KILL_POINTS).
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_TINY = """
[model]
n_layer = 4
n_head = 4
n_embd = {width}
block_size = 32
[parallel]
tp = 2
dp = 2
[train]
steps = {steps}
global_batch_size = 8
micro_batch_size = 2
warmup_steps = 2
log_interval = 1000
eval_interval = 1000
[data]
path = "{data}"
"""


def _torchrun(work: Path, cfg: Path, out: str, extra: list[str], nproc: int = 4) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "megalite", "train", "--config", str(cfg), f"--train.out_dir={work / out}", *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _losses(run_dir: Path) -> dict[int, float]:
    from megalite.run.metrics import read
    return {r["step"]: r["loss"] for r in read(run_dir)}


def _workers(pid: int) -> list[int]:
    """Child processes of the torchrun agent (the ranks)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def stress_ckpt(trials: int = 5, steps: int = 12, width: int = 64, workdir: str | None = None, seed: int = 0,
                log=print) -> dict:
    """Each trial: train with a save every step (sync and async alternating), SIGKILL a random rank at a
    random moment once saving has begun, then check that `latest` names a checkpoint that verifies and
    that resuming from it reproduces the uninterrupted run's losses exactly. Without `workdir` it works in a
    temporary folder, removed at the end."""
    if workdir:  # the caller's folder: kept, to look at
        Path(workdir).mkdir(parents=True, exist_ok=True)
        return _stress_ckpt(Path(workdir), trials, steps, width, seed, log)
    work = Path(tempfile.mkdtemp(prefix="megalite-stress-"))
    try:  # a temporary folder (checkpoints, token file, logs): removed whatever happens
        return _stress_ckpt(work, trials, steps, width, seed, log)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _stress_ckpt(work: Path, trials: int, steps: int, width: int, seed: int, log) -> dict:
    from megalite.checkpoint.verify import verify
    from megalite.data import default_corpus_files, prepare
    rng = random.Random(seed)
    data = work / "tokens.bin"
    if not data.exists():
        prepare(default_corpus_files(max_bytes=300_000), data, log=lambda *a: None)
    cfg = work / "stress.toml"
    cfg.write_text(_TINY.format(width=width, steps=steps, data=data))
    ref = _torchrun(work, cfg, "reference", [])
    ref_out = ref.communicate()[0]
    if ref.returncode:
        raise RuntimeError(f"stress: the reference run failed:\n{ref_out[-2000:]}")
    reference = _losses(work / "reference")
    results = {"trials": 0, "valid_latest": 0, "resumed_exactly": 0, "killed_mid_save": 0}
    for trial in range(trials):
        ck = work / f"ckpt-{trial}"
        shutil.rmtree(ck, ignore_errors=True)
        mode = "async" if trial % 2 else "sync"
        args = [f"--checkpoint.dir={ck}", "--checkpoint.interval=1", f"--checkpoint.async={mode == 'async'}",
                "--checkpoint.keep_last=2"]
        proc = _torchrun(work, cfg, f"trial-{trial}", args)
        deadline = time.monotonic() + 120
        while not (ck / "latest").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 1.0))
        victims = _workers(proc.pid)
        victim = rng.choice(victims) if victims else None
        in_save = time.monotonic() + 10  # aim inside a save: wait (bounded) until one is in progress
        while not any(ck.glob(".tmp-step_*")) and proc.poll() is None and time.monotonic() < in_save:
            time.sleep(0.0005)
        if victim is not None and proc.poll() is None:
            mid_save = any(ck.glob(".tmp-step_*"))  # a save's temporary folder existed just before the kill
            os.kill(victim, signal.SIGKILL)
            results["killed_mid_save"] += int(mid_save)
        try:
            proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        results["trials"] += 1
        step, problems = verify(ck)
        if problems:
            log(f"trial {trial} ({mode}): latest is NOT valid: {problems[0]}")
            continue
        results["valid_latest"] += 1
        resumed = _torchrun(work, cfg, f"trial-{trial}", args + ["--checkpoint.resume=auto"])
        out = resumed.communicate(timeout=300)[0]
        if resumed.returncode:
            log(f"trial {trial} ({mode}): resume failed:\n{out[-1500:]}")
            continue
        got = _losses(work / f"trial-{trial}")
        start = int(step.name.split("_")[1])
        same = all(got.get(s) == reference[s] for s in range(start + 1, steps + 1))
        results["resumed_exactly"] += int(same)
        log(f"trial {trial} ({mode}): killed a rank; latest = {step.name} verifies; resumed from step {start}: "
            f"losses {'identical' if same else 'DIFFER'} to the uninterrupted run")
    log("")
    log(f"{'trials':>8}{'valid latest':>14}{'resumed exactly':>17}{'killed mid-save':>17}{'data lost':>11}")
    lost = results["trials"] - results["valid_latest"]
    log(f"{results['trials']:>8}{results['valid_latest']:>14}{results['resumed_exactly']:>17}"
        f"{results['killed_mid_save']:>17}{lost:>11}")
    return results


def main(argv=None) -> int:
    """`python -m benchmarks stress ckpt [--trials N]`: exit 0 when every trial left a valid `latest` that
    resumed exactly, 1 otherwise."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m benchmarks stress",
                                description="fault injection: `stress ckpt` kills a random rank mid-save, N times, "
                                            "and checks that latest stays valid and resumes exactly",
                                epilog="example:\n  python -m benchmarks stress ckpt --trials 10",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["ckpt"])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--width", type=int, default=64, help="model n_embd (bigger: longer saves)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    r = stress_ckpt(trials=a.trials, steps=a.steps, width=a.width, workdir=a.workdir, seed=a.seed)
    return 0 if r["valid_latest"] == r["trials"] == r["resumed_exactly"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
