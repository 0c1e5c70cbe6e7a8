"""Helpers shared by the checkpoint tests: a tiny config, launching `megalite train` (alone or under
torchrun) as a subprocess, reading metrics, and comparing checkpoint trees."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from megalite.config import Config

TIMEOUT = 180  # seconds for any one subprocess

TINY = {
    "model": dict(n_layer=4, n_head=4, n_embd=32, block_size=16, vocab_size=256, dropout=0.0),
    "parallel": dict(tp=1, pp=1, dp=1, schedule="1f1b", zero1=False),
    "train": dict(steps=6, global_batch_size=8, micro_batch_size=2, lr=3e-3, min_lr=3e-4, warmup_steps=2,
                  weight_decay=0.1, grad_clip=1.0, seed=1234, log_interval=1000, eval_interval=1000,
                  eval_batches=1),
    "data": dict(val_fraction=0.1, auto_prepare=False),
}


@pytest.fixture(scope="session")
def ckpt_tokens(request, tmp_path_factory) -> Path:
    """The shared token file of conftest.py when there is one, else our own (~50 KB of stdlib source)."""
    try:
        return Path(request.getfixturevalue("token_file"))
    except pytest.FixtureLookupError:
        from megalite.data import prepare
        d = tmp_path_factory.mktemp("ckpt-tokens")
        src = Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"
        (d / "corpus.txt").write_text(src.read_text(encoding="utf-8")[:50_000], encoding="utf-8")
        prepare([d / "corpus.txt"], d / "tok.bin", log=lambda *a: None)
        return d / "tok.bin"


def tiny_cfg(tokens, tp=1, pp=1, dp=1, **overrides) -> Config:
    """A tiny Config; overrides as {"section.key": value}."""
    raw = json.loads(json.dumps(TINY))
    raw["parallel"].update(tp=tp, pp=pp, dp=dp)
    raw["data"]["path"] = str(tokens)
    cfg = Config.from_dict(raw, source="tiny")
    for dotted, value in overrides.items():
        section, key = dotted.split(".")
        setattr(getattr(cfg, section), key, value)
    return cfg


def write_toml(path: Path, tokens, **sections) -> Path:
    """The tiny config as TOML; sections={"model": {"dropout": 0.1}} overrides keys."""
    def fmt(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        return repr(v)

    raw = json.loads(json.dumps(TINY))
    raw["data"]["path"] = str(tokens)
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    lines = []
    for section, values in raw.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {fmt(v)}" for k, v in values.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in [k for k in e if k in ("WORLD_SIZE", "RANK", "LOCAL_RANK") or k.startswith("MEGALITE_CRASH")]:
        del e[k]
    return e


def train_cmd(config: Path, nproc: int = 1, *overrides: str) -> list:
    if nproc == 1:
        head = [sys.executable, "-m", "megalite", "train"]
    else:
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                "-m", "megalite", "train"]
    return head + ["--config", str(config), *overrides]


def train(config: Path, *overrides: str, nproc: int = 1, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(train_cmd(config, nproc, *overrides), env=env(), capture_output=True, text=True,
                          timeout=timeout)


def popen_train(config: Path, *overrides: str, nproc: int = 1) -> subprocess.Popen:
    return subprocess.Popen(train_cmd(config, nproc, *overrides), env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n" \
                                 f"{proc.stderr[-4000:]}"
    return proc


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megalite", *args], env=env(), capture_output=True, text=True,
                          timeout=timeout)


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def losses(out_dir: Path) -> list:
    return [(r["step"], r["loss"]) for r in metrics(out_dir)]


def coord_files(step: Path) -> dict:
    """{relative path: bytes} of every file in the coordinate folders of one step folder."""
    step = Path(step)
    return {str(f.relative_to(step)): f.read_bytes() for f in sorted(step.glob("*/*")) if f.is_file()}


def step_names(root: Path) -> list:
    return sorted(p.name for p in Path(root).iterdir() if p.is_dir() and p.name.startswith("step_"))


def children(pid: int) -> list:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(x) for x in out]


def kill_tree(proc: subprocess.Popen) -> None:
    """Clean up a launch that a test left running (its workers first, then torchrun)."""
    if proc.poll() is not None:
        return
    for pid in children(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.kill()
    proc.communicate(timeout=30)


def wait_for(pred, timeout: float, interval: float = 0.002) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return False


def copy_step(step: Path, root: Path) -> Path:
    """Copy one committed step folder into a new checkpoint root that names it `latest`."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copytree(step, root / step.name)
    (root / "latest").write_text(step.name + "\n")
    return root / step.name


def same_file(a: Path, b: Path) -> bool:
    """Byte-equal, or for safetensors: the same keys, dtypes, shapes, metadata and bitwise-equal tensors
    (safetensors writes its metadata map in no fixed order, so equal checkpoints need not be equal bytes)."""
    a, b = Path(a), Path(b)
    if a.read_bytes() == b.read_bytes():
        return True
    if a.suffix != ".safetensors":
        return False
    from safetensors import safe_open
    with safe_open(str(a), framework="pt") as fa, safe_open(str(b), framework="pt") as fb:
        if sorted(fa.keys()) != sorted(fb.keys()) or fa.metadata() != fb.metadata():
            return False
        for k in fa.keys():
            x, y = fa.get_tensor(k), fb.get_tensor(k)
            if x.dtype != y.dtype or x.shape != y.shape or not bool((x.view(-1).view(torch_int(x)) ==
                                                                      y.view(-1).view(torch_int(y))).all()):
                return False
    return True


def torch_int(t):
    """The integer dtype of a float tensor's width, to compare bit patterns (NaN == NaN, -0 != +0)."""
    import torch
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]


def same_step_files(a: Path, b: Path) -> None:
    fa, fb = coord_files(a), coord_files(b)
    assert fa.keys() == fb.keys() and fa, (sorted(fa), sorted(fb))
    differ = [rel for rel in fa if not same_file(Path(a) / rel, Path(b) / rel)]
    assert not differ, f"{a} and {b} differ in {differ}"


def verify_cli(path) -> tuple:
    """`megalite verify PATH` in this process (no interpreter start-up): (exit code, stdout + stderr)."""
    import contextlib
    import io

    from megalite.cli import main
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = main(["verify", str(path)])
    return rc, buf.getvalue()
