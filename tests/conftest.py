"""Shared fixtures: a small token file, a tiny-config builder, and in-process training of a reference."""
from __future__ import annotations

import copy
import sysconfig
from pathlib import Path

import pytest
import torch

from megalite.config import Config
from megalite.data import prepare


def _corpus_text() -> str:
    """~60 KB of deterministic text: the start of a stdlib module's source."""
    src = Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"
    return src.read_text(encoding="utf-8")[:60_000]


@pytest.fixture(scope="session")
def token_file(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tokens")
    (d / "corpus.txt").write_text(_corpus_text(), encoding="utf-8")
    out = d / "tiny.bin"
    prepare([d / "corpus.txt"], out, val_fraction=0.1, log=lambda *a: None)
    return out


TINY = {
    "model": dict(n_layer=4, n_head=4, n_embd=32, block_size=16, vocab_size=256, dropout=0.0),
    "parallel": dict(tp=1, pp=1, dp=1, schedule="1f1b", zero1=False),
    "train": dict(steps=5, global_batch_size=16, micro_batch_size=2, lr=3e-3, min_lr=3e-4, warmup_steps=2,
                  weight_decay=0.1, grad_clip=1.0, seed=1234, log_interval=1000, eval_interval=1000,
                  eval_batches=1),
    "data": dict(val_fraction=0.1, auto_prepare=False),
}


@pytest.fixture
def tiny_config(token_file, tmp_path):
    """make(**{"section.key": value}) -> a tiny Config on the shared token file, out_dir in tmp."""

    def make(**overrides) -> Config:
        raw = copy.deepcopy(TINY)
        raw["data"]["path"] = str(token_file)
        raw["train"]["out_dir"] = str(tmp_path / "run")
        cfg = Config.from_dict(raw, source="tiny")
        for dotted, value in overrides.items():
            section, key = dotted.split(".")
            setattr(getattr(cfg, section), key, value)
        return cfg

    return make


@pytest.fixture
def tiny_toml(token_file, tmp_path) -> Path:
    """The tiny config as a TOML file (for the CLI / torchrun tests)."""

    def fmt(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return f'"{v}"'
        return repr(v)

    lines = []
    raw = copy.deepcopy(TINY)
    raw["data"]["path"] = str(token_file)
    raw["train"]["out_dir"] = str(tmp_path / "run")
    for section, values in raw.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {fmt(v)}" for k, v in values.items()]
        lines.append("")
    path = tmp_path / "tiny.toml"
    path.write_text("\n".join(lines))
    return path


@pytest.fixture
def train_single():
    """Train a config in this process (a world of one, single-threaded like the workers); return
    {"history": per-step metrics, "loss": per-step losses, "params": full params, "grads": full grads of
    the last step}."""

    def run(cfg: Config):
        from megalite.testing import gather_full_model
        from megalite.train import train
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            tr = train(cfg, log=lambda *a: None)
        finally:
            torch.set_num_threads(threads)
        return {"history": tr.history, "loss": [r["loss"] for r in tr.history],
                "params": gather_full_model(tr.params, tr.grid),
                "grads": gather_full_model(grads_of(tr.params), tr.grid)}

    return run


def grads_of(named_params) -> list:
    """(name, grad) pairs whose grads carry their parameter's partition tag (for gather_full_model)."""
    out = []
    for name, p in named_params:
        g = p.grad.detach().clone()
        g.partition = p.partition
        out.append((name, g))
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (or the absolute norm when b is zero)."""
    a, b = a.double(), b.double()
    denom = b.norm().item()
    return (a - b).norm().item() / (denom if denom > 0 else 1.0)
