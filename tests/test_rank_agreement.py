"""Ranks that see different settings (issue 21, class 1), on a real 2-rank gloo job (run_parallel; the torchrun
form with two config files is in test_error_contract_torchrun.py's matrix).

Before: a different train.lr on one dp rank trained silently wrong; a different train.steps or layout hung in
a collective until the process-group timeout; a different checkpoint.dir (a relative path against another
working directory) printed `checkpoint: saved`, exit 0, with no step that verifies. Now every rank's resolved
config, its absolute paths and the token file's identity are agreed at start-up: any difference is one line,
the same on every rank, naming the field and which rank holds what, and nothing is written. The commit itself
verifies what it commits (every coordinate's files where rank 0 looks) before `latest` moves.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from helpers import CKPT, assert_still_at_step_1, same_on_every_rank
from megalite.testing import run_parallel

BASE = {"model.n_layer": 2, "parallel.dp": 2, "train.steps": 2}

# name, overrides of rank 0 and of rank 1, fragments of the one line every rank raises
CASES = [
    ("lr", {}, {"train.lr": 0.002}, ["ranks disagree on train.lr:", "rank 0 has 0.003", "rank 1 has 0.002"]),
    ("steps", {}, {"train.steps": 7}, ["ranks disagree on train.steps:", "rank 1 has 7"]),
    ("layout", {}, {"parallel.tp": 2, "parallel.dp": 1},
     ["ranks disagree on parallel.tp:", "rank 1 has 2", "(and 1 more: parallel.dp)"]),
    ("lr-nan-on-one-rank", {}, {"train.lr": float("nan")}, ["ranks disagree on train.lr:", "rank 1 has nan"]),
    # the same text in both configs, resolved against each rank's own working directory
    ("relative-checkpoint-dir", {"checkpoint.dir": "ck"}, {"checkpoint.dir": "ck"},
     ["ranks disagree on checkpoint.dir (resolved):", "host0/ck", "host1/ck"]),
    # the same path, other bytes on rank 1's host (simulated: rank 1 identifies a copy with one byte changed)
    ("token-file-content", {}, {}, ["ranks disagree on data.path (token file):", "content hash"]),
]


def _disagreeing_ranks(rank, world_size, tmp_dir, tokens):
    import megalite.run.train as train_mod
    from megalite.base.errors import StartupError
    tmp, home = Path(tmp_dir), os.getcwd()
    for name, *overrides, fragments in CASES:
        case = tmp / name
        host = case / f"host{rank}"
        host.mkdir(parents=True, exist_ok=True)
        cfg = CKPT.config(tokens, case / "out", **{**BASE, "checkpoint.dir": str(case / "ck"), **overrides[rank]})
        real = train_mod.data_identity
        if name == "token-file-content" and rank == 1:
            from megalite.data import identity
            changed = host / "t.bin"
            data = bytearray(Path(tokens).read_bytes())
            data[0] ^= 1
            changed.write_bytes(bytes(data))
            shutil.copy(Path(tokens).with_suffix(".json"), host / "t.json")
            train_mod.data_identity = lambda path: identity(changed)
        os.chdir(host)
        try:
            with pytest.raises(StartupError) as e:
                train_mod.train(cfg, log=lambda *a: None)
        finally:
            os.chdir(home)
            train_mod.data_identity = real
        msg = str(e.value)
        same_on_every_rank(msg, world_size)
        assert e.value.shared and "\n" not in msg and all(f in msg for f in fragments), (name, msg)
        assert not (case / "out").exists() and not (case / "ck").exists() and not (host / "ck").exists(), name


def test_ranks_with_different_settings_stop_at_start_up_naming_the_field(tmp_path, token_file):
    run_parallel(_disagreeing_ranks, 2, tmp_path, args=(str(token_file),))


def _writes_elsewhere(rank, world_size, tmp_dir, tokens):
    import torch
    import megalite.checkpoint.commit as commit_mod
    from megalite.checkpoint import CheckpointError, save_checkpoint
    from megalite.checkpoint.tree import committed_steps
    from megalite.parallel.grid import Layout, ParallelGrid
    from megalite.run.train import build, train_step
    tmp = Path(tmp_dir)
    grid = ParallelGrid.create(Layout(1, 1, 2))
    tr = build(CKPT.config(tokens, **{"model.n_layer": 2, "parallel.dp": 2}), grid, torch.device("cpu"))
    train_step(tr)
    # the Python API with a root per rank: refused before any rank writes a file
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(tmp / f"mine{rank}", 1, tr.model, tr.optimizer, grid)
    same_on_every_rank(str(e.value), world_size)
    assert "rank 1 saves under" in str(e.value) and "mine1" in str(e.value) and "mine0" in str(e.value)
    assert not (tmp / "mine1").exists() and committed_steps(tmp / "mine0") == []
    assert not (tmp / "mine0" / "latest").exists()
    # one root, but rank 1's files land elsewhere (another mount at the same path, say): the commit's own check
    root = tmp / "ck"
    save_checkpoint(root, 1, tr.model, tr.optimizer, grid)
    train_step(tr)
    real = commit_mod.write_rank
    if rank == 1:
        commit_mod.write_rank = lambda folder, pay, rel, *more: real(tmp / "elsewhere" / rel, pay, rel, *more)
    try:
        with pytest.raises(CheckpointError) as e:
            save_checkpoint(root, 2, tr.model, tr.optimizer, grid)
    finally:
        commit_mod.write_rank = real
    msg = str(e.value)
    same_on_every_rank(msg, world_size)
    assert "tp00-pp00-dp01" in msg and "same checkpoint.dir" in msg and "still names step_00000001" in msg, msg
    assert_still_at_step_1(root)


def test_a_save_whose_ranks_write_to_different_places_never_moves_latest(tmp_path, token_file):
    run_parallel(_writes_elsewhere, 2, tmp_path, args=(str(token_file),))


def test_token_file_identity_is_the_content_not_the_path(tmp_path, token_file):
    """The identity ranks compare: the same for a copy at another path (another host's copy of the corpus),
    different after one byte changes in a block it reads, after a truncation, or with another .json."""
    from megalite.data import identity, meta_path
    src = Path(token_file)
    data = src.read_bytes()

    def copy(name, body, meta=None):
        out = tmp_path / f"{name}.bin"
        out.write_bytes(body)
        meta_path(out).write_bytes(meta if meta is not None else meta_path(src).read_bytes())
        return out

    same = identity(src)
    assert identity(copy("copy", data)) == same and same.startswith(f"{len(data)} bytes")
    for name, body, meta in (("first", bytes([data[0] ^ 1]) + data[1:], None),
                             ("last", data[:-1] + bytes([data[-1] ^ 1]), None),
                             ("short", data[:-2], None),
                             ("meta", data, meta_path(src).read_bytes() + b" ")):
        assert identity(copy(name, body, meta)) != same, name
    assert identity(tmp_path / "none.bin") == "missing"
