"""Helpers for testing parallel code on CPU: run a function on N gloo ranks from a pytest test.

    from megalite.testing import run_parallel

    def _check(rank, world_size, shared_dir):
        ...  # torch.distributed is initialised (gloo); assert things here

    def test_my_layer(tmp_path):
        run_parallel(_check, world_size=4, tmp_dir=tmp_path)

The function must be importable (defined at module top level). Workers rendezvous through a file in
`tmp_dir`, run with OMP_NUM_THREADS=1, and the first failing rank's traceback is re-raised in the test.
"""
from __future__ import annotations

import os
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing import connection as mp_connection


class RankFailed(AssertionError):
    """A worker raised; the message holds its rank and full traceback."""


def _worker(rank: int, fn: Callable, world_size: int, init_file: str, tmp_dir: str, args: tuple, errors) -> None:
    os.environ.update({"OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size)})
    import torch
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=120))
        fn(rank, world_size, tmp_dir, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        os._exit(1)  # do not wait for peers that may be blocked in a collective
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_parallel(fn: Callable[..., Any], world_size: int, tmp_dir: str | os.PathLike | None = None,
                 args: tuple = ()) -> None:
    """Run fn(rank, world_size, tmp_dir, *args) on world_size gloo processes; raise if any rank fails."""
    tmp = Path(tmp_dir) if tmp_dir is not None else Path(tempfile.mkdtemp(prefix="megalite-"))
    tmp.mkdir(parents=True, exist_ok=True)
    init_file = tmp / f"rendezvous-{os.getpid()}-{id(fn)}"
    if init_file.exists():
        init_file.unlink()
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, fn, world_size, str(init_file), str(tmp), args, errors))
             for r in range(world_size)]
    for p in procs:
        p.start()
    failed = None
    alive = list(procs)
    while alive:  # wait on all sentinels; once one rank fails, the others may hang in a collective
        mp_connection.wait([p.sentinel for p in alive])
        for p in [p for p in alive if not p.is_alive()]:
            p.join()
            alive.remove(p)
            if p.exitcode != 0 and failed is None:
                failed = p
        if failed is not None:
            for q in alive:
                q.join(timeout=2)
                if q.is_alive():
                    q.kill()
                    q.join()
            break
    if not errors.empty():
        rank, tb = errors.get()
        raise RankFailed(f"rank {rank} of {world_size} failed:\n{tb}")
    if failed is not None:
        raise RankFailed(f"a rank exited with code {failed.exitcode} without a Python error")


def gather_full_model(named_params, grid) -> dict:
    """Reassemble every parameter's full global tensor on every rank (tests only: holds the whole model).

    Reads each parameter's partition tag: tp slices are all-gathered over tp and concatenated along the
    split dim (padding dropped); pipeline stages exchange their parameters over the model-parallel group.
    """
    import torch
    from .parallel.tensor import partition_of, valid_view
    mine = {}
    for name, p in named_params:
        part = partition_of(p)
        if part.tied_to:
            continue
        local = valid_view(p.detach(), part, grid.tp.rank, grid.tp.size).cpu()
        if part.dim is not None and grid.tp.active:
            pieces = [None] * grid.tp.size
            dist.all_gather_object(pieces, local, group=grid.tp.group)
            local = torch.cat(pieces, dim=part.dim)
        mine[name] = local
    if grid.mp.active:
        everyone = [None] * grid.mp.size
        dist.all_gather_object(everyone, mine, group=grid.mp.group)
        for d in everyone:
            mine.update(d)
    return mine
