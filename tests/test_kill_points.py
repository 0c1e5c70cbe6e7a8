"""The commit protocol has no bad window: a process SIGKILLed at each of its boundaries in turn (the kill
points of megalite.base.faults) leaves `latest` naming a step that verifies, and resume=auto then continues the
uninterrupted run's loss curve bit for bit. One process per kill (forked from this one, so no interpreter
start-up), killed by itself at a named point with SIGKILL: no finally, no cleanup, like a real crash."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest

from helpers import CKPT, step_names, tmp_dirs, train_in_process
from megalite.checkpoint.tree import read_latest
from megalite.checkpoint.verify import verify
from megalite.base.faults import KILL_POINTS
from megalite.testing import run_parallel

STEPS = 4
EXACT = ("step", "loss", "lr", "grad_norm", "tokens_seen", "val_loss", "batch_hash")


def _exact(records: list) -> list:
    return [{k: r[k] for k in EXACT if k in r} for r in records]


def _config(tokens, tmp, **kw):
    return CKPT.config(tokens, tmp / "out", **{"model.n_layer": 2, "model.dropout": 0.1, "train.steps": STEPS,
                                               "checkpoint.dir": str(tmp / "ck"), "checkpoint.interval": 1, **kw})


def _child(cfg, env: dict) -> None:
    os.environ.update(env)
    train_in_process(cfg)
    os._exit(0)  # the kill point was never reached


def _train_killed(cfg, point: str, nth: int, extra_env: dict | None = None) -> None:
    """Train `cfg` in a forked process that SIGKILLs itself the nth time it reaches `point`."""
    assert point in KILL_POINTS
    env = {"MEGALITE_KILL_POINT": point, "MEGALITE_KILL_NTH": str(nth), **(extra_env or {})}
    p = mp.get_context("fork").Process(target=_child, args=(cfg, env))
    p.start()
    p.join(120)
    if p.is_alive():
        p.kill()
    assert p.exitcode == -signal.SIGKILL, f"{point} #{nth}: exit {p.exitcode}, the kill point was not reached"


@pytest.fixture(scope="module")
def reference(token_file, tmp_path_factory):
    """The uninterrupted run (checkpoints every step, so its RNG use matches the killed runs')."""
    d = tmp_path_factory.mktemp("kill-ref")
    return _exact(train_in_process(_config(token_file, d)).history)


def _resume_and_compare(tokens, tmp, reference, expect_from: int | None = None) -> None:
    root = tmp / "ck"
    logs = []
    tr = train_in_process(_config(tokens, tmp, **{"checkpoint.resume": "auto"}), log=logs.append)
    resumed = [line for line in logs if line.startswith("resumed from")]
    assert resumed, logs
    k = int(resumed[0].split(" at step ")[1].split()[0])
    if expect_from is not None:
        assert k == expect_from, resumed
    assert _exact(tr.history) == reference[k:], f"resumed at step {k}: the curve differs"
    assert read_latest(root) == f"step_{STEPS:08d}" and verify(root)[1] == [] and tmp_dirs(root) == []


def _latest_verifies(root) -> str:
    latest = read_latest(root)
    step, problems = verify(root)
    assert latest and problems == [], (latest, problems, step_names(root), tmp_dirs(root))
    return latest


# point, which occurrence to die at, the step `latest` must name right after the kill
FRESH = [
    ("slices_written", 2, 1),    # step 2's slices are on disk, no manifest
    ("manifest_written", 2, 1),  # step 2's manifest written, not fsynced
    ("manifest_synced", 2, 1),   # .tmp-step_2 complete, not renamed
    ("renamed", 2, 1),           # step_2 committed, `latest` still names step 1
    ("latest_written", 2, 2),    # `latest` names step 2, pruning not done
    ("pruning", 1, 2),           # keep_last=1: saving step 2 had deleted step 1 when the kill came
]


@pytest.mark.parametrize("point,nth,latest_after", FRESH, ids=[c[0] for c in FRESH])
def test_kill_at_each_boundary_of_a_save(tmp_path, token_file, reference, point, nth, latest_after):
    _train_killed(_config(token_file, tmp_path, **{"checkpoint.keep_last": 1}), point, nth)
    assert _latest_verifies(tmp_path / "ck") == f"step_{latest_after:08d}"
    _resume_and_compare(token_file, tmp_path, reference, expect_from=latest_after)


def test_kill_in_an_async_save(tmp_path, token_file, reference):
    """The background thread of an async save dies with the process at the same boundaries."""
    _train_killed(_config(token_file, tmp_path, **{"checkpoint.async": True}), "manifest_synced", 2)
    assert _latest_verifies(tmp_path / "ck") == "step_00000001"
    _resume_and_compare(token_file, tmp_path, reference, expect_from=1)


@pytest.mark.parametrize("exchange", [True, False], ids=["rename-exchange", "two-renames"])
def test_kill_during_a_resave_of_the_step_latest_names(tmp_path, token_file, reference, exchange):
    """A rollback: steps 1-2 committed, `latest` = step 2; a run resumed from step 1 re-saves step 2 and is
    killed between putting the new copy in and removing the old one. With RENAME_EXCHANGE step_2 is never
    missing; without it (`MEGALITE_NO_RENAME_EXCHANGE`), the next start finishes the interrupted re-save."""
    root = tmp_path / "ck"
    train_in_process(_config(token_file, tmp_path, **{"train.stop_at_step": 2}))
    assert read_latest(root) == "step_00000002"
    rollback = _config(token_file, tmp_path, **{"checkpoint.resume": str(root / "step_00000001")})
    if exchange:
        _train_killed(rollback, "resave_swapped", 1)
        assert _latest_verifies(root) == "step_00000002"
    else:
        _train_killed(rollback, "resave_old_moved", 1, {"MEGALITE_NO_RENAME_EXCHANGE": "1"})
        assert read_latest(root) == "step_00000002" and not (root / "step_00000002").exists()
        assert tmp_dirs(root) == [".tmp-old-step_00000002", ".tmp-step_00000002"]
    _resume_and_compare(token_file, tmp_path, reference, expect_from=2)


ZERO3 = {"parallel.dp": 2, "parallel.zero": 3, "model.dropout": 0.0}  # dropout off: resumed at (1,1,1) below


def _zero3_worker(rank, world_size, tmp_dir, tokens):
    from pathlib import Path
    train_in_process(_config(tokens, Path(tmp_dir), **ZERO3, **{"checkpoint.keep_last": 1}))


def test_kill_at_each_boundary_of_a_zero3_save(tmp_path, token_file, monkeypatch):
    """ZeRO-3 at dp 2 (each rank writes the chunks it holds): one rank SIGKILLed at each boundary of a fresh
    save (rank 1 after writing its slices, rank 0 at the steps only it takes); run_parallel then ends the
    other rank, as torchrun would. `latest` names the last whole step, it verifies, and it resumes, here in
    one process at zero 0, continuing the single process's curve (1e-5 relative: the dp 2 steps before it
    round their reductions otherwise)."""
    from megalite.parallel.process_group import GLOO_GONE
    from megalite.testing import RankFailed
    ref = _exact(train_in_process(_config(token_file, tmp_path / "ref", **{"model.dropout": 0.0})).history)
    for point, nth, latest_after in FRESH:
        d = tmp_path / point
        for k, v in {"MEGALITE_KILL_POINT": point, "MEGALITE_KILL_NTH": str(nth),
                     "MEGALITE_KILL_RANK": "1" if point == "slices_written" else "0"}.items():
            monkeypatch.setenv(k, v)
        with pytest.raises(RankFailed) as died:
            run_parallel(_zero3_worker, 2, d, args=(token_file,))
        said = str(died.value)  # the other rank's collective found its peer gone (gloo's words), or the kill itself
        assert any(w in said for w in (*GLOO_GONE, "killed by a signal")), said[-400:]
        monkeypatch.delenv("MEGALITE_KILL_POINT")
        assert _latest_verifies(d / "ck") == f"step_{latest_after:08d}", point
        logs = []
        tr = train_in_process(_config(token_file, d, **{"model.dropout": 0.0, "checkpoint.resume": "auto"}),
                              log=logs.append)
        assert any(line.startswith("resumed from") and f" at step {latest_after} " in line for line in logs), logs
        got = _exact(tr.history)
        assert [r["step"] for r in got] == [r["step"] for r in ref[latest_after:]], point
        worst = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(got, ref[latest_after:]))
        assert worst < 1e-5, (point, worst)


def test_every_kill_point_is_exercised():
    used = {c[0] for c in FRESH} | {"resave_swapped", "resave_old_moved"}
    assert used == set(KILL_POINTS)


# ---------------------------------------------------------------- the order of fsyncs and renames (issue 21)
def test_the_commit_makes_each_thing_durable_before_anything_names_it(tmp_path, monkeypatch):
    """A kill loses nothing that the kill tests can see (the page cache survives a process); a power cut loses
    what was never fsynced. So record every os.fsync (by the path of its descriptor) and every rename of a
    save and a re-save, and check the protocol's order: each file and folder of the step is fsynced before the
    step folder is renamed into place, the manifest last of all, the root after the rename; `latest` is
    written to a fsynced temporary file, renamed over, and the root fsynced again. With the manifest's fsync
    (or the step folder's) dropped, `latest` could name a manifest that is not on the disk."""
    import torch
    from megalite.checkpoint import save_checkpoint
    from megalite.parallel.grid import ParallelGrid
    events = []
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(kind, real):
        def fn(src, dst, *a, **k):
            events.append((kind, os.fspath(src), os.fspath(dst)))
            return real(src, dst, *a, **k)
        return fn

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", rename("rename", real_replace))
    monkeypatch.setattr(os, "rename", rename("rename", real_rename))
    monkeypatch.setenv("MEGALITE_NO_RENAME_EXCHANGE", "1")  # the re-save's two-rename path: every move is seen
    net = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.ones(2, 4)).sum().backward()
    opt.step()
    root = tmp_path / "ck"
    for attempt in ("save", "re-save"):
        events.clear()
        save_checkpoint(root, 1, net, opt, ParallelGrid.single())
        tmp, final, coord = str(root / ".tmp-step_00000001"), str(root / "step_00000001"), "tp00-pp00-dp00"
        into_place = next(i for i, e in enumerate(events) if e[:2] == ("rename", tmp) and e[2] == final)
        synced = [e[1] for e in events[:into_place] if e[0] == "fsync"]
        files = [f"{tmp}/{coord}/{n}" for n in ("model.safetensors", "optimizer.safetensors", "state.json")]
        for path in files + [f"{tmp}/{coord}", f"{tmp}/manifest.json", tmp]:
            assert path in synced, (attempt, path, events)
        assert synced.index(f"{tmp}/manifest.json") > max(synced.index(f) for f in files), attempt
        assert synced.index(tmp) > synced.index(f"{tmp}/manifest.json"), attempt  # the folder entry, after
        after = events[into_place + 1:]
        latest = next(i for i, e in enumerate(after) if e[0] == "rename" and e[2] == str(root / "latest"))
        assert ("fsync", str(root)) in after[:latest], (attempt, "the root after the rename", after)
        assert after[latest][1] == str(root / ".latest.tmp")
        assert ("fsync", str(root / ".latest.tmp")) in after[:latest], (attempt, after)
        assert ("fsync", str(root)) in after[latest + 1:], (attempt, "the root after `latest`", after)
    assert (root / "latest").read_text() == "step_00000001\n"
