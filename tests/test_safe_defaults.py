"""Safe by default (issue: the first hour, round two): checkpoints are on unless turned off, rerunning a
command continues the run, a fresh start never replaces another run's checkpoints (refused, or moved aside
with --force), metrics.jsonl is appended and never truncated, a finished run says so."""
import torch

import helpers as H
from helpers import cli, metrics, metrics_lines, one_line_error, tree_digest
from megalite.checkpoint.tree import committed_steps, read_latest
from megalite.config import Config, resolve, validate
from megalite.run.train import train

DEFAULT_DIR = Config().checkpoint.dir  # "{out_dir}/checkpoints"


def _cfg(token_file, out, steps, **more):
    return H.CKPT.config(token_file, out, **{"train.steps": steps, "checkpoint.dir": DEFAULT_DIR, **more})


def _train(cfg, force=False):
    lines = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(cfg, log=lambda *a: lines.append(" ".join(map(str, a))), force=force)
    finally:
        torch.set_num_threads(threads)
    return "\n".join(lines)


def test_defaults_are_checkpoints_on_and_resume_auto(tmp_path):
    cfg = validate(resolve(Config.from_dict({"train": {"out_dir": str(tmp_path / "run")}}), 1), 1)
    assert cfg.checkpoint.dir == str(tmp_path / "run" / "checkpoints")
    assert cfg.checkpoint.resume == "auto" and cfg.checkpoint.interval > 0
    off = validate(resolve(Config.from_dict({"checkpoint": {"dir": ""}}), 1), 1)
    assert off.checkpoint.dir == ""  # the documented way to turn checkpoints off


def test_rerunning_the_same_command_continues_the_run(tmp_path, token_file):
    out = tmp_path / "run"
    first = _train(_cfg(token_file, out, 3))
    root = out / "checkpoints"
    assert committed_steps(root) == [3] and read_latest(root) == "step_00000003", first  # saved at the end
    again = _train(_cfg(token_file, out, 3))  # the same command: nothing to do, and it says so
    assert "already finished (step 3/3" in again and "--train.steps" in again, again
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]
    longer = _train(_cfg(token_file, out, 5))  # a longer run continues; the schedule change is announced
    assert f"resumed from {root / 'step_00000003'} at step 3" in longer, longer
    assert "train.steps 3 -> 5" in longer and "LR schedule" in longer, longer
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4, 5]
    events = [r for r in metrics_lines(out) if "event" in r]
    assert [(e["event"], e["step"]) for e in events] == [("resume", 3), ("resume", 3)]
    # an uninterrupted 5-step run takes the same steps 4 and 5 (the schedule is a function of train.steps)
    ref = tmp_path / "ref"
    _train(_cfg(token_file, ref, 5, **{"checkpoint.dir": ""}))
    assert [r["loss"] for r in metrics(out)][3:] == [r["loss"] for r in metrics(ref)][3:]


def test_fresh_start_into_a_used_folder_is_refused_and_changes_nothing(tmp_path, token_file):
    out = tmp_path / "run"
    toml = H.CKPT.toml(tmp_path / "tiny.toml", token_file, out, train={"steps": 2},
                       checkpoint={"dir": DEFAULT_DIR})
    H.ok(H.train(toml))
    before, lines_before = tree_digest(out), (out / "metrics.jsonl").read_text()
    line = one_line_error(H.train(toml, "--checkpoint.resume=none"))
    assert str(out / "checkpoints") in line and "--force" in line and "resume=auto" in line, line
    assert tree_digest(out) == before and (out / "metrics.jsonl").read_text() == lines_before


def test_force_moves_the_old_run_aside_and_deletes_nothing(tmp_path, token_file):
    out = tmp_path / "run"
    _train(_cfg(token_file, out, 2))
    old_ckpt, old_metrics = tree_digest(out / "checkpoints"), (out / "metrics.jsonl").read_text()
    log = _train(_cfg(token_file, out, 3, **{"checkpoint.resume": "none"}), force=True)
    aside = [p for p in tmp_path.joinpath("run").iterdir() if p.name.startswith("checkpoints.old-")]
    assert len(aside) == 1 and tree_digest(aside[0]) == old_ckpt, log
    assert committed_steps(out / "checkpoints") == [3]
    moved = [p for p in out.iterdir() if p.name.startswith("metrics.") and p.name != "metrics.jsonl"]
    assert len(moved) == 1 and moved[0].read_text() == old_metrics
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]


def test_cli_force_flag_reaches_the_run(tmp_path, token_file):
    out = tmp_path / "run"
    toml = H.CKPT.toml(tmp_path / "tiny.toml", token_file, out, train={"steps": 1},
                       checkpoint={"dir": DEFAULT_DIR})
    H.ok(H.train(toml))
    r = H.ok(cli("train", "--config", toml, "--checkpoint.resume=none", "--force", cwd=tmp_path))
    assert "moved the previous checkpoints" in r.stdout, r.stdout
    assert len([p for p in out.iterdir() if p.name.startswith("checkpoints.old-")]) == 1


def test_force_never_moves_or_replaces_a_live_runs_checkpoints(tmp_path, token_file):
    """--force moves an old run's checkpoints aside, and `convert --force` replaces its own outputs, but neither
    touches a folder whose lock a live run holds (base/lock.held, probed from another open file here: flock
    locks of two open files conflict even in one process)."""
    import pytest
    from megalite.base.errors import ConvertError, MegaliteError
    from megalite.base.lock import RunLock
    from megalite.convert.common import check_out
    out = tmp_path / "run"
    _train(_cfg(token_file, out, 1))
    root = out / "checkpoints"
    live = RunLock(root / "lock")
    assert live.take() is None
    try:
        before = tree_digest(out)
        with pytest.raises(MegaliteError, match=r"is in use by a live run .*lock is locked\); not moving it"):
            _train(_cfg(token_file, out, 2, **{"checkpoint.resume": "none"}), force=True)
        with pytest.raises(ConvertError, match=r"a training run holds .*lock; refusing to replace a live run's"):
            check_out(root, True, [], "checkpoint")
        assert tree_digest(out) == before
    finally:
        live.release()
