"""Nothing outside the checkpoint folder, nothing good lost: symlinks planted in a checkpoint root are never
followed, `latest` names a step of this root only, pruning keeps what it did not write (a newer history, a
checkpoint that failed verification), a NaN never reaches the weights or a checkpoint. In-process runs."""
from __future__ import annotations

import shutil

import pytest

from helpers import CKPT, step_names, tmp_dirs, train_in_process
from megalite.checkpoint.tree import read_latest
from megalite.checkpoint.verify import verify
from megalite.base.errors import NonFiniteError

MODEL = "tp00-pp00-dp00/model.safetensors"


def _cfg(tokens, tmp, **kw):
    return CKPT.config(tokens, tmp / "out", **{"model.n_layer": 2, "train.steps": 4, "checkpoint.dir": str(tmp / "ck"),
                                               "checkpoint.interval": 1, **kw})


def _run(tokens, tmp, **kw):
    logs = []
    tr = train_in_process(_cfg(tokens, tmp, **kw), log=logs.append)
    return tr, logs


def test_symlinked_latest_tmp_is_replaced_never_followed(tmp_path, token_file):
    root = tmp_path / "ck"
    root.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("must not change\n")
    (root / ".latest.tmp").symlink_to(victim)
    _run(token_file, tmp_path, **{"train.steps": 2})
    assert victim.read_text() == "must not change\n"
    assert not (root / "latest").is_symlink() and read_latest(root) == "step_00000002"
    assert not (root / ".latest.tmp").exists() and not (root / ".latest.tmp").is_symlink()


def test_latest_naming_another_runs_step_is_not_followed_and_prunes_nothing_newer(tmp_path, token_file):
    """The issue's case: `latest` = ../other/ckpt/step_.. ; resume=auto ignores it (loudly), resumes from this
    root's newest step that verifies, and keep_last never deletes this root's newer checkpoints."""
    _run(token_file, tmp_path, **{"train.stop_at_step": 3})
    other = tmp_path / "other" / "ckpt"
    shutil.copytree(tmp_path / "ck", other)
    root = tmp_path / "ck"
    (root / "latest").write_text("../other/ckpt/step_00000001\n")
    tr, logs = _run(token_file, tmp_path, **{"checkpoint.resume": "auto", "checkpoint.keep_last": 1})
    assert any(line.startswith("WARNING: resume=auto: ignoring") and "../other" in line for line in logs), logs
    assert any(line.startswith(f"resumed from {root / 'step_00000003'} at step 3") for line in logs), logs
    assert step_names(root) == ["step_00000004"] and read_latest(root) == "step_00000004"
    assert step_names(other) == ["step_00000001", "step_00000002", "step_00000003"]


def test_pruning_keeps_a_newer_history(tmp_path, token_file):
    """Steps 1-5 committed, `latest` rolled back to 2 by hand: a run resuming from 2 that saves every 2 steps
    with keep_last=1 deletes only steps up to its resume point; 3 and 5 (not written by it) survive."""
    root = tmp_path / "ck"
    _run(token_file, tmp_path, **{"train.steps": 6, "train.stop_at_step": 5})
    (root / "latest").write_text("step_00000002\n")
    tr, logs = _run(token_file, tmp_path, **{"train.steps": 6, "checkpoint.resume": "auto", "checkpoint.keep_last": 1,
                                             "checkpoint.interval": 2})
    assert any(line.startswith(f"resumed from {root / 'step_00000002'} at step 2") for line in logs), logs
    assert step_names(root) == ["step_00000003", "step_00000004", "step_00000005", "step_00000006"]
    assert read_latest(root) == "step_00000006" and verify(root)[1] == [] and tmp_dirs(root) == []


def test_a_step_that_failed_verification_is_kept_with_a_warning(tmp_path, token_file):
    root = tmp_path / "ck"
    _run(token_file, tmp_path, **{"train.steps": 6, "train.stop_at_step": 3})  # steps 1-3
    f = root / "step_00000003" / MODEL
    f.write_bytes(f.read_bytes()[:-8])
    damaged = f.read_bytes()
    tr, logs = _run(token_file, tmp_path, **{"train.steps": 6, "checkpoint.resume": "auto", "checkpoint.keep_last": 1,
                                             "checkpoint.interval": 2})
    assert any("falling back" in line and "step_00000002" in line for line in logs), logs
    assert any(line.startswith("WARNING: resume=auto: keeping the checkpoint(s) that failed verification "
                               "(step_00000003)") for line in logs), logs
    assert step_names(root) == ["step_00000003", "step_00000006"] and f.read_bytes() == damaged  # evidence kept
    assert read_latest(root) == "step_00000006" and verify(root)[1] == []


def test_nan_loss_stops_before_the_update_and_latest_stays_good(tmp_path, token_file, capsys):
    root = tmp_path / "ck"
    kw = {"train.lr": 1e5, "train.min_lr": 0.0, "train.grad_clip": 0.0, "train.warmup_steps": 0, "train.steps": 6}
    with pytest.raises(NonFiniteError, match=r"^step 2: loss .* grad-norm nan is not finite.*on_nonfinite=stop"):
        _run(token_file, tmp_path, **kw)
    assert read_latest(root) == "step_00000001" and verify(root)[1] == [] and tmp_dirs(root) == []
    # skip: the update of each non-finite step is dropped; the weights and every checkpoint stay finite
    shutil.rmtree(root)
    tr, logs = _run(token_file, tmp_path, **kw, **{"train.on_nonfinite": "skip"})
    skipped = [r["step"] for r in tr.history if r.get("skipped")]
    assert skipped and skipped[0] == 2 and tr.optimizer.step_count == 6 - len(skipped), tr.history
    assert "step 2: loss" in capsys.readouterr().out  # the warning, on rank 0's stdout
    assert all(bool(p.isfinite().all()) for _, p in tr.params)
    assert read_latest(root) == "step_00000006" and verify(root)[1] == []


def test_write_latest_never_follows_a_planted_temp_file(tmp_path):
    """write_latest itself (not only the start-up tidy-up) replaces a symlink or a stale file at .latest.tmp."""
    from megalite.checkpoint.tree import write_latest
    victim = tmp_path / "victim.txt"
    victim.write_text("must not change\n")
    (tmp_path / ".latest.tmp").symlink_to(victim)
    write_latest(tmp_path, "step_00000007")
    assert victim.read_text() == "must not change\n" and read_latest(tmp_path) == "step_00000007"
    assert not (tmp_path / "latest").is_symlink() and not (tmp_path / ".latest.tmp").is_symlink()
    with pytest.raises(ValueError):
        write_latest(tmp_path, "../elsewhere/step_00000001")  # only a step folder name of this root


def test_disk_full_while_writing_latest_says_the_step_is_committed(tmp_path, token_file, monkeypatch):
    """ENOSPC while `latest` is written: the step folder is already committed (and verifies); the error says
    so and what `latest` still names; no .latest.tmp is left."""
    import errno
    import os

    from megalite.checkpoint import CheckpointError
    from megalite.checkpoint import tree as layout
    real, calls = os.write, []

    def full(fd, data):
        if not os.readlink(f"/proc/self/fd/{fd}").endswith(".latest.tmp"):
            return real(fd, data)
        calls.append(fd)
        if len(calls) == 2:  # the second `latest` of the run: step 2's
            real(fd, bytes(data)[:3])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(layout.os, "write", full)
    root = tmp_path / "ck"
    with pytest.raises(CheckpointError) as e:
        _run(token_file, tmp_path, **{"train.steps": 2})
    monkeypatch.setattr(layout.os, "write", real)
    msg = str(e.value)
    assert "step 2 was committed as" in msg and "No space left" in msg and "still names step_00000001" in msg, msg
    assert "not saved" not in msg
    assert read_latest(root) == "step_00000001" and not os.path.lexists(root / ".latest.tmp")
    assert verify(root / "step_00000002")[1] == [] and verify(root)[1] == []


def test_a_pruning_failure_is_reported_and_not_counted_as_deleted(tmp_path, monkeypatch, capsys):
    """keep_last cannot delete an old step (EACCES, EBUSY on a network filesystem): the save stands, the
    step is named in a warning, and prune does not report it as deleted."""
    import errno

    from megalite.checkpoint import tree as layout
    root = tmp_path / "ck"
    for s in (1, 2, 3):  # committed-looking folders: pruning only needs the names and a manifest file
        (root / layout.step_dir(s)).mkdir(parents=True)
        (root / layout.step_dir(s) / layout.MANIFEST).write_text("{}")
    layout.write_latest(root, layout.step_dir(3))
    real = layout.remove_tree

    def stuck(path):
        if path.name == layout.step_dir(1):
            raise OSError(errno.EACCES, "Permission denied")
        real(path)

    monkeypatch.setattr(layout, "remove_tree", stuck)
    assert layout.prune(root, keep_last=1, saved=3) == [2]
    assert layout.committed_steps(root) == [1, 3]
    err = capsys.readouterr().err
    assert "could not delete" in err and layout.step_dir(1) in err and "Permission denied" in err


def test_a_root_that_cannot_be_listed_prunes_nothing_and_the_save_stands(tmp_path, monkeypatch, capsys):
    """tree.publish after the rename: `latest` is written, then the prune cannot list the root (EIO on a network
    filesystem): nothing is deleted, a warning names the root, and no error reaches the commit (which would
    otherwise say that `latest` could not be updated)."""
    import errno

    from megalite.checkpoint import tree as layout
    root = tmp_path / "ck"
    for s in (1, 2):
        (root / layout.step_dir(s)).mkdir(parents=True)
        (root / layout.step_dir(s) / layout.MANIFEST).write_text("{}")

    def unlistable(_root):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(layout, "committed_steps", unlistable)
    assert layout.publish(root, 2, keep_last=1) == []
    assert layout.read_latest(root) == layout.step_dir(2) and (root / layout.step_dir(1)).is_dir()
    err = capsys.readouterr().err
    assert "could not list" in err and str(root) in err and "Input/output error" in err
