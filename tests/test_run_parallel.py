"""megalite.testing.run_parallel, the helper every multi-rank test stands on: its workers come from a fork server
that imported torch once (not a fresh interpreter per rank), so check that each worker still gets what a fresh
`spawn` process would: the caller's environment and working directory at the call, none of the caller's
in-memory state, and that a failing rank is reported with its rank and traceback."""
import json
import os
import re
from pathlib import Path

import pytest

import megalite.faults
from megalite.testing import RankFailed, run_parallel


def _report(rank, world_size, tmp):
    import torch.distributed as dist
    import megalite.faults as faults
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
    monkeypatch.setitem(megalite.faults._reached, "caller-only", 7)
    run_parallel(_report, 2, tmp_path / "second")
    for rank in (0, 1):
        seen = json.loads((tmp_path / "second" / f"{rank}.json").read_text())
        assert seen == {"var": "set after", "gone": None, "cwd": str(tmp_path), "rank": str(rank), "omp": "1",
                        "caller_state": {}, "world": 2}, seen


def test_a_failing_rank_is_reported_with_its_traceback(tmp_path):
    with pytest.raises(RankFailed, match=r"(?s)rank 1 of 2 failed:.*ValueError: planted failure on rank 1"):
        run_parallel(_fail_on_rank_1, 2, tmp_path)


# docs/testing.md: begin
import torch, torch.distributed as dist
from megalite.testing import run_parallel

def _check_allreduce(rank, world_size, tmp_dir):
    # runs on each of 4 gloo CPU ranks; torch.distributed is already initialised
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)
    assert x.item() == sum(range(world_size))

def test_allreduce(tmp_path):
    run_parallel(_check_allreduce, world_size=4, tmp_dir=tmp_path)  # a failing rank's traceback is re-raised
# docs/testing.md: end


def test_the_docs_show_this_files_run_parallel_example_verbatim():
    here = Path(__file__).read_text()
    example = here.split("# docs/testing.md: begin\n")[1].split("# docs/testing.md: end\n")[0]
    docs = (Path(__file__).resolve().parent.parent / "docs" / "testing.md").read_text()
    assert any(example.strip() == b.strip() for b in re.findall(r"```python\n(.*?)```", docs, re.S))
