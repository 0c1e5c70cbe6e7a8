"""Fault injection and `megalite stress ckpt`: kill ranks mid-save and check that nothing is lost.

`maybe_crash` lets a test make one rank die hard at a chosen step (to exercise `torchrun --max-restarts`):
    MEGALITE_CRASH_AT_STEP=5 MEGALITE_CRASH_RANK=1 MEGALITE_CRASH_ONCE=/tmp/marker
The marker file makes it happen once, so the restarted workers run through.

`slow_step` makes every step from a chosen one on take S seconds longer (a sleep between the last backward
and the optimizer update, on every rank), so that a test can land a stop signal in the middle of a step
slower than the launcher's grace period:
    MEGALITE_SLOW_STEP_S=3 MEGALITE_SLOW_FROM_STEP=3

`kill_point` makes a process die hard (SIGKILL, no cleanup of any kind) at a named boundary of the
checkpoint commit protocol, deterministically:
    MEGALITE_KILL_POINT=manifest_synced MEGALITE_KILL_RANK=0 MEGALITE_KILL_NTH=2
kills rank 0 the second time it reaches that point. The points, in protocol order (checkpoint/save.py):
KILL_POINTS.
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


KILL_POINTS = (
    "slices_written",    # a rank has written and fsynced its coordinate folder (before rank 0 hears of it)
    "manifest_written",  # rank 0 has written manifest.json into .tmp-step_N
    "manifest_synced",   # ... and fsynced the folder: the temporary step is complete
    "resave_swapped",    # re-save: the new step_N swapped in atomically, the old copy not yet removed
    "resave_old_moved",  # re-save without RENAME_EXCHANGE: the old step_N moved aside, the new not yet in
    "renamed",           # .tmp-step_N is step_N (fsynced), `latest` still names the previous step
    "latest_written",    # `latest` names step_N, pruning not yet done
    "pruning",           # the first old step of this prune has been deleted
)
_reached: dict = {}


def kill_point(name: str) -> None:
    """SIGKILL this process here if MEGALITE_KILL_POINT names this point (see the module docstring)."""
    want = os.environ.get("MEGALITE_KILL_POINT")
    if want != name:
        return
    if int(os.environ.get("RANK", "0")) != int(os.environ.get("MEGALITE_KILL_RANK", "0")):
        return
    _reached[name] = _reached.get(name, 0) + 1
    if _reached[name] == int(os.environ.get("MEGALITE_KILL_NTH", "1")):
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_crash(step: int, rank: int) -> None:
    at = os.environ.get("MEGALITE_CRASH_AT_STEP")
    if not at or int(at) != step or int(os.environ.get("MEGALITE_CRASH_RANK", "0")) != rank:
        return
    marker = os.environ.get("MEGALITE_CRASH_ONCE")
    if marker:
        if os.path.exists(marker):
            return
        Path(marker).write_text(f"crashed at step {step} on rank {rank}\n")
    print(f"megalite: injected crash at step {step} on rank {rank}", file=sys.stderr, flush=True)
    os._exit(13)


def slow_step(step: int) -> None:
    """Sleep MEGALITE_SLOW_STEP_S seconds in step `step` (1-based) if it is >= MEGALITE_SLOW_FROM_STEP (default 1).
    A signal during the sleep runs its handler and the sleep goes on (PEP 475), as a long step would."""
    seconds = float(os.environ.get("MEGALITE_SLOW_STEP_S", "0") or 0)
    if seconds > 0 and step >= int(os.environ.get("MEGALITE_SLOW_FROM_STEP", "1")):
        time.sleep(seconds)


# ---------------------------------------------------------------- the stress harness
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
    from .metrics import read
    return {r["step"]: r["loss"] for r in read(run_dir)}


def _workers(pid: int) -> list[int]:
    """Child processes of the torchrun agent (the ranks)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def stress_ckpt(trials: int = 5, steps: int = 12, width: int = 64, workdir: str | None = None, seed: int = 0,
                log=print) -> dict:
    """Each trial: train with a save every step (sync and async alternating), SIGKILL a random rank at a
    random moment once saving has begun, then check that `latest` names a checkpoint that verifies and
    that resuming from it reproduces the uninterrupted run's losses exactly."""
    from .checkpoint.verify import verify
    from .data import default_corpus_files, prepare
    rng = random.Random(seed)
    work = Path(workdir or tempfile.mkdtemp(prefix="megalite-stress-"))
    work.mkdir(parents=True, exist_ok=True)
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
