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


# Workers are forked from a fork server that imported torch and megalite once, not started as fresh
# interpreters ("spawn"), which import torch again in every rank: ~2 s of CPU apiece, most of a small
# parallel test's time on a 2-core machine (8 ranks: 20 s -> 0.2 s there, under load). Each worker is still
# a fresh process holding no state of the caller; it gets the caller's cwd and sys.path (multiprocessing's
# preparation data) and, passed below, the caller's environment at the call, as spawn would give it.
_PRELOAD = ["torch", "torch.distributed", "megalite.train", "megalite.testing"]


def _context():
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # no effect once the server runs (it already has them)
    return ctx


def _worker(rank: int, fn: Callable, world_size: int, init_file: str, tmp_dir: str, args: tuple, errors,
            env: dict) -> None:
    os.environ.clear()
    os.environ.update(env)  # the caller's environment now, not the fork server's from when it started
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
    ctx = _context()
    errors = ctx.SimpleQueue()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, fn, world_size, str(init_file), str(tmp), args, errors, env))
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
    from .parallel.partition import partition_of, valid_view
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


# ---------------------------------------------------------------- checkpoint round trips
def _round_trip_worker(rank, world_size, tmp_dir, cfg_dict, phase, ckpt, steps):
    from .checkpoint import load_checkpoint, save_checkpoint
    from .config import Config
    from .parallel.grid import Layout, ParallelGrid
    from .parallel.process_group import init_distributed
    from .train import build, train_step
    cfg = Config.from_dict(cfg_dict)
    device, _ = init_distributed()
    grid = ParallelGrid.create(Layout(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp))
    tr = build(cfg, grid, device)
    if phase == "save":
        for _ in range(steps):
            train_step(tr)
        save_checkpoint(ckpt, tr.step, tr.model, tr.optimizer, grid, config=cfg.to_dict(),
                        data_state=tr.sampler.state_dict())
    else:
        info = load_checkpoint(ckpt, tr.model, tr.optimizer, grid, model_config=cfg.to_dict()["model"])
        save_checkpoint(Path(ckpt).parent / "reloaded", info.step, tr.model, tr.optimizer, grid,
                        config=cfg.to_dict(), data_state=info.data)


def full_state(ckpt) -> dict:
    """Every model and optimizer tensor of a checkpoint, whole, by global name (reads the manifest only)."""
    from .checkpoint import manifest as mf
    from .checkpoint.tree import Box, resolve
    from .checkpoint.read import SliceReader
    step = resolve(ckpt)
    man = mf.read(step)
    reader = SliceReader(step, man)
    return {f"{'model' if e.kind == 'model' else 'optimizer_state'}/{e.name}": reader.read(e, Box.whole(e.shape))
            for e in man.tensors()}


def assert_round_trip(tmp_dir, save_layout: tuple, load_layout: tuple, *, model: dict | None = None,
                      data_path: str | None = None, zero1: tuple = (False, False), steps: int = 1) -> None:
    """Train `steps` at save_layout (tp, pp, dp), checkpoint, load into a fresh run at load_layout, save
    again, and assert that every model tensor and every AdamW moment is bitwise what was saved.

        def test_tp2_to_pp2(tmp_path):
            assert_round_trip(tmp_path, save_layout=(2, 1, 1), load_layout=(1, 2, 1))
    """
    import torch
    from .config import Config
    from .data import prepare
    tmp = Path(tmp_dir)
    if data_path is None:
        src = tmp / "corpus.txt"
        src.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(2000)))
        data_path = str(tmp / "tokens.bin")
        prepare([src], data_path, log=lambda *a: None)
    base = {"model": model or {"n_layer": 4, "n_head": 4, "n_embd": 32, "block_size": 16},
            "train": {"global_batch_size": 8, "micro_batch_size": 2, "steps": steps, "out_dir": str(tmp / "run")},
            "data": {"path": data_path}}
    ckpt = tmp / "ckpt"
    for phase, layout, z in (("save", save_layout, zero1[0]), ("load", load_layout, zero1[1])):
        d = Config.from_dict({**base, "parallel": {"tp": layout[0], "pp": layout[1], "dp": layout[2],
                                                   "zero1": z}}).to_dict()
        run_parallel(_round_trip_worker, layout[0] * layout[1] * layout[2], tmp / f"rdzv-{phase}",
                     args=(d, phase, str(ckpt), steps))
    before, after = full_state(ckpt), full_state(tmp / "reloaded")
    assert before.keys() == after.keys(), f"tensor names differ: {sorted(before.keys() ^ after.keys())[:5]}"
    for name in before:
        if not torch.equal(before[name], after[name]):
            diff = (before[name] - after[name]).abs().max().item()
            raise AssertionError(f"{name}: not bitwise equal after {save_layout} -> {load_layout} "
                                 f"(max abs diff {diff:.3g})")
