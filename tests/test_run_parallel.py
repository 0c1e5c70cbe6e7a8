"""megalite.testing.run_parallel, the helper every multi-rank test stands on: its workers come from a fork server
that imported torch once (not a fresh interpreter per rank), so check that each worker still gets what a fresh
`spawn` process would: the caller's environment and working directory at the call, none of the caller's
in-memory state, and that a failing rank is reported with its rank and traceback."""
import json
import os
import re

import pytest

import megalite.base.faults
from megalite.testing import RankFailed, run_parallel


def _report(rank, world_size, tmp):
    import torch.distributed as dist
    import megalite.base.faults as faults
    seen = {"var": os.environ.get("MEGALITE_TEST_RP"), "gone": os.environ.get("MEGALITE_TEST_RP_GONE"),
            "cwd": os.getcwd(), "rank": os.environ["RANK"], "omp": os.environ["OMP_NUM_THREADS"],
            "caller_state": dict(faults._reached), "world": dist.get_world_size()}
    with open(f"{tmp}/{rank}.json", "w") as f:
        json.dump(seen, f)
    dist.barrier()  # no rank leaves while another is still joining


def _fail_on_rank_1(rank, world_size, tmp):
    import torch.distributed as dist
    dist.barrier()
    if rank == 1:
        raise ValueError("planted failure on rank 1")


def test_workers_get_the_callers_environment_and_cwd_but_not_its_state(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGALITE_TEST_RP_GONE", "set before the first launch")
    run_parallel(_report, 2, tmp_path / "first")  # the fork server (if any) starts here, or already runs
    assert json.loads((tmp_path / "first" / "0.json").read_text())["gone"] == "set before the first launch"
    # after the server started: a new variable, a removed one, another cwd, state only this process has
    monkeypatch.setenv("MEGALITE_TEST_RP", "set after")
    monkeypatch.delenv("MEGALITE_TEST_RP_GONE")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(megalite.base.faults._reached, "caller-only", 7)
    run_parallel(_report, 2, tmp_path / "second")
    for rank in (0, 1):
        seen = json.loads((tmp_path / "second" / f"{rank}.json").read_text())
        assert seen == {"var": "set after", "gone": None, "cwd": str(tmp_path), "rank": str(rank), "omp": "1",
                        "caller_state": {}, "world": 2}, seen


def test_a_failing_rank_is_reported_with_its_traceback(tmp_path):
    with pytest.raises(RankFailed, match=r"(?s)rank 1 of 2 failed:.*ValueError: planted failure on rank 1"):
        run_parallel(_fail_on_rank_1, 2, tmp_path)


# docs/testing.md's run_parallel example (test_allreduce) runs from the page itself, as its own test file in a
# fresh interpreter: tests/test_docs.py::test_every_pytest_block_passes_as_its_own_file


def test_a_worker_that_cannot_import_its_function_says_so(tmp_path, monkeypatch):
    """The function's module imports here but not in the workers (changed on disk after): the failure names
    the import and carries its error, not "exited with code 1 without a Python error"."""
    import importlib
    import sys
    mod = tmp_path / "megalite_rp_probe_mod.py"
    mod.write_text("def work(rank, world_size, tmp):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    probe = importlib.import_module("megalite_rp_probe_mod")
    mod.write_text("raise ImportError('planted: a missing dependency')\n")
    try:
        with pytest.raises(RankFailed) as e:
            run_parallel(probe.work, 1, tmp_path / "run")
    finally:
        sys.modules.pop("megalite_rp_probe_mod", None)
    msg = str(e.value)
    assert "could not import megalite_rp_probe_mod (to run work)" in msg and "planted: a missing dependency" in msg
    assert "without a Python error" not in msg


# ---------------------------------------------------------------- the deadline (issue 21)
def _mismatched_schedules(rank, world_size, tmp):
    """A schedule bug: pipeline stage 0 runs 1F1B, stage 1 all-forward-all-backward over 4 micro-batches. Stage 0
    sends activations 0 and 1, then waits for gradient 0; stage 1 waits for activation 2 before any backward."""
    import torch
    from megalite.parallel.grid import Layout, ParallelGrid
    from megalite.parallel.pipeline import P2P, afab, one_f_one_b
    grid = ParallelGrid.create(Layout(1, 2, 1))
    w = torch.ones(3, requires_grad=True)
    p2p = P2P(grid, (3,), torch.float32, torch.device("cpu"))
    inputs = [torch.full((3,), float(i)) for i in range(4)]
    (one_f_one_b if rank == 0 else afab)(lambda x, i: (x * w).sum() if grid.is_last_stage else x * w,
                                         inputs, 4, grid, p2p)


def test_a_hung_launch_names_each_rank_and_where_it_waits_within_the_deadline(tmp_path):
    """The deadline, not a gloo timeout minutes later: each rank still running is named with the call it is
    blocked in (a recv), the schedule function and this test's worker, in seconds."""
    import time
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as e:
        run_parallel(_mismatched_schedules, 2, tmp_path, deadline_s=8)
    took, msg = time.monotonic() - t0, str(e.value)
    assert took < 25, took  # the deadline plus the launch; the workers' own collective timeout is 8 + 30 s
    assert "_mismatched_schedules: 2 of 2 ranks still running after the 8 s deadline (killed)" in msg, msg
    first = msg.splitlines()
    rank0 = next(line for line in first if line.startswith("rank 0 waits in "))
    rank1 = next(line for line in first if line.startswith("rank 1 waits in "))
    assert re.search(r"recv_backward \(pipeline\.py:\d+\) <- backward \(pipeline\.py:\d+\) <- one_f_one_b", rank0)
    assert re.search(r"recv_forward \(pipeline\.py:\d+\) <- forward \(pipeline\.py:\d+\) <- afab", rank1)
    assert "_mismatched_schedules (test_run_parallel.py:" in rank0 and rank0.split(" waits in ")[1].startswith("recv")
    assert not list(tmp_path.glob("stacks-*"))  # the dumps are read and removed


def _noop(rank, world_size, tmp):
    pass


def test_without_a_tmp_dir_the_launch_removes_the_folder_it_made(tmp_path, monkeypatch):
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    run_parallel(_noop, 1)
    with pytest.raises(RankFailed, match="planted failure"):
        run_parallel(_fail_on_rank_1, 2)
    # (multiprocessing's own pymp-* folder, if its fork server started here, goes when this process exits)
    assert [p for p in tmp_path.iterdir() if p.name.startswith("megalite")] == [], "run_parallel left its folder"
