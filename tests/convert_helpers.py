"""Shared pieces of the converter tests: a token file, tiny configs, training runs (in-process and under
torchrun) cached once per pytest session, and small file utilities.

The runs are cached in a module-level dict keyed by pytest's base temp folder, so every test module that
asks for one gets the same folders without depending on conftest.py.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from megalite.config import Config
from megalite.data import prepare

SEED = 7
TINY_MODEL = dict(n_layer=4, n_head=4, n_embd=32, block_size=16, vocab_size=256, dropout=0.0)
TINY = {
    "model": TINY_MODEL,
    "parallel": dict(tp=1, pp=1, dp=1, schedule="1f1b", zero1=False),
    "train": dict(steps=10, global_batch_size=8, micro_batch_size=2, lr=3e-3, min_lr=3e-4, warmup_steps=2,
                  weight_decay=0.1, grad_clip=1.0, seed=SEED, log_interval=1000, eval_interval=1000,
                  eval_batches=1),
    "data": dict(val_fraction=0.1, auto_prepare=False),
}
TORCHRUN_TIMEOUT = 240
CLI_TIMEOUT = 120

_CACHE: dict = {}


def cached(tmp_path_factory, key: str, make):
    """make(folder) once per session for `key`; the folder is a fresh temp dir."""
    k = (str(tmp_path_factory.getbasetemp()), key)
    if k not in _CACHE:
        _CACHE[k] = make(tmp_path_factory.mktemp(key))
    return _CACHE[k]


# ---------------------------------------------------------------- data
def corpus_text(n: int = 50_000) -> str:
    """~50 KB of deterministic, varied English-and-code-like text written here (no external files)."""
    words = ("the model splits every tensor across ranks and the converter puts it back together one slice "
             "at a time def return class import for while if else print yield lambda pipeline stage tensor "
             "parallel data optimizer moment checkpoint manifest shard layout resume gradient loss step "
             "batch token vocabulary embedding attention head layer norm residual projection").split()
    out, i, x = [], 0, 12345
    while sum(len(s) for s in out) < n:
        x = (1103515245 * x + 12345) % 2**31
        w = words[x % len(words)]
        i += 1
        out.append(w + ("\n" if i % 13 == 0 else ". " if i % 7 == 0 else " "))
    return "".join(out)[:n]


def token_file(tmp_path_factory) -> Path:
    def make(d: Path) -> Path:
        (d / "corpus.txt").write_text(corpus_text(), encoding="utf-8")
        prepare([d / "corpus.txt"], d / "tok.bin", val_fraction=0.1, log=lambda *a: None)
        return d / "tok.bin"
    return cached(tmp_path_factory, "convert_tokens", make)


# ---------------------------------------------------------------- configs and training
def make_config(tok: Path, out_dir: Path, **overrides) -> Config:
    """The tiny config; overrides as {"section.key": value}."""
    raw = copy.deepcopy(TINY)
    raw["data"]["path"] = str(tok)
    raw["train"]["out_dir"] = str(out_dir)
    for dotted, v in overrides.items():
        section, key = dotted.split(".")
        raw.setdefault(section, {})[key] = v
    return Config.from_dict(raw, source="test")


def write_toml(path: Path, tok: Path) -> Path:
    def fmt(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        return f'"{v}"' if isinstance(v, str) else repr(v)
    raw = copy.deepcopy(TINY)
    raw["data"]["path"] = str(tok)
    lines = []
    for section, values in raw.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {fmt(v)}" for k, v in values.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def train_in_process(cfg: Config) -> list[float]:
    """Train in this process (a world of one, one thread); return the losses of the steps it ran."""
    from megalite.train import train
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tr = train(cfg, log=lambda *a: None)
    finally:
        torch.set_num_threads(threads)
    return [r["loss"] for r in tr.history]


def sub_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def torchrun_train(nproc: int, toml: Path, out_dir: Path, **overrides) -> list[dict]:
    """`torchrun --standalone --nproc-per-node N -m megalite train`; return metrics.jsonl records."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "megalite", "train", "--config", str(toml), f"--train.out_dir={out_dir}"]
    cmd += [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in overrides.items()]
    r = subprocess.run(cmd, env=sub_env(), capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT)
    assert r.returncode == 0, f"torchrun failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return read_metrics(out_dir)


def read_metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines() if line]


def cli(*args, timeout: int = CLI_TIMEOUT) -> subprocess.CompletedProcess:
    """`megalite ARGS` in a plain subprocess (no torchrun)."""
    return subprocess.run([sys.executable, "-m", "megalite", *map(str, args)], env=sub_env(), capture_output=True,
                          text=True, timeout=timeout)


def assert_one_line_error(r: subprocess.CompletedProcess, cmd: str, pattern: str) -> None:
    import re
    assert r.returncode == 2, f"exit {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}"
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one stderr line, got:\n{r.stderr}"
    assert "Traceback" not in r.stderr + r.stdout
    assert lines[0].startswith(f"megalite {cmd}: error: "), lines[0]
    assert re.search(pattern, lines[0]), f"{pattern!r} not in {lines[0]!r}"


# ---------------------------------------------------------------- cached runs
def trained_111(tmp_path_factory) -> dict:
    """(1,1,1) in-process, steps=10, stopped after step 5 with a checkpoint."""
    def make(d: Path) -> dict:
        tok = token_file(tmp_path_factory)
        cfg = make_config(tok, d / "run", **{"train.stop_at_step": 5, "checkpoint.dir": str(d / "ckpt")})
        losses = train_in_process(cfg)
        return {"ckpt": d / "ckpt", "losses": losses, "dir": d}
    return cached(tmp_path_factory, "convert_trained_111", make)


def model_file(tmp_path_factory) -> Path:
    """The (1,1,1) checkpoint converted to one fp32 megalite file."""
    from megalite.convert import convert

    def make(d: Path) -> Path:
        return convert(trained_111(tmp_path_factory)["ckpt"], d / "model.safetensors", quiet=True)
    return cached(tmp_path_factory, "convert_model_file", make)


def run_222_stop5(tmp_path_factory) -> dict:
    """(2,2,2) zero1 under torchrun (8 procs), steps=10, stopped after step 5 with a checkpoint."""
    def make(d: Path) -> dict:
        tok = token_file(tmp_path_factory)
        toml = write_toml(d / "tiny.toml", tok)
        recs = torchrun_train(8, toml, d / "run", **{"parallel.tp": 2, "parallel.pp": 2, "parallel.dp": 2,
                                                      "parallel.zero1": True, "train.stop_at_step": 5,
                                                      "checkpoint.dir": d / "ckpt"})
        return {"ckpt": d / "ckpt", "toml": toml, "metrics": recs, "dir": d}
    return cached(tmp_path_factory, "convert_run_222_stop5", make)


def run_222_full(tmp_path_factory) -> list[dict]:
    """The uninterrupted 10-step (2,2,2) zero1 run (the reference for resumed runs)."""
    def make(d: Path) -> list[dict]:
        toml = write_toml(d / "tiny.toml", token_file(tmp_path_factory))
        return torchrun_train(8, toml, d / "run", **{"parallel.tp": 2, "parallel.pp": 2, "parallel.dp": 2,
                                                      "parallel.zero1": True})
    return cached(tmp_path_factory, "convert_run_222_full", make)


# ---------------------------------------------------------------- files
def tree_digest(root: Path) -> dict:
    """{relative path: sha256} of every file under root (to prove a source was not touched)."""
    root = Path(root)
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    d = b.norm().item()
    return (a - b).norm().item() / (d if d > 0 else 1.0)
