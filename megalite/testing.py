"""Helpers for testing parallel code on CPU: run a function on N gloo ranks from a pytest test.

    from megalite.testing import run_parallel

    def _check(rank, world_size, shared_dir):
        ...  # torch.distributed is initialised (gloo); assert things here

    def test_my_layer(tmp_path):
        run_parallel(_check, world_size=4, tmp_dir=tmp_path)

The function must be importable (defined at module top level). Workers rendezvous through a file in
`tmp_dir`, run with OMP_NUM_THREADS=1, and the first failing rank's traceback is re-raised in the test.
A launch that has not finished within `deadline_s` (default DEADLINE_S, or $MEGALITE_TEST_DEADLINE_S) is
stopped: every rank still running dumps its Python stack (faulthandler), and the failure names each such rank
and where it waits (a schedule bug: "rank 0 waits in recv_backward <- one_f_one_b ..."), instead of a gloo
timeout much later; the workers' collectives time out only after the deadline.

`gather_full_model` reassembles a parallel model's full tensors; `assert_round_trip` saves any model and
optimizer at one layout, loads and re-saves them at another, and asserts every tensor bitwise equal
(docs/testing.md).
"""
from __future__ import annotations

import faulthandler
import os
import re
import shutil
import signal
import tempfile
import time
import traceback
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
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "megalite.run.train", "megalite.testing"]


def _context():
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # no effect once the server runs (it already has them)
    return ctx


DEADLINE_S = 300.0  # a whole launch; the longest in the suite (8 ranks, several runs) takes about a minute
STACK_SIGNAL = signal.SIGUSR1  # asks a worker for its stacks (faulthandler writes them to its stack file)


def _by_name(fn: Callable):
    """A top-level function travels as (module, name) and is imported inside the worker's try block: an
    import that fails there is reported as such, with its traceback (unpickled by multiprocessing before
    the worker runs, it would end the process with code 1 and no error on the queue)."""
    name = getattr(fn, "__qualname__", "")
    if getattr(fn, "__module__", None) and name and "<" not in name:
        return (fn.__module__, name)
    return fn


def _resolve(fn):
    if not isinstance(fn, tuple):
        return fn
    import importlib
    try:
        obj = importlib.import_module(fn[0])
    except BaseException as e:
        raise ImportError(f"the worker could not import {fn[0]} (to run {fn[1]}): {type(e).__name__}: {e}") from e
    for part in fn[1].split("."):
        obj = getattr(obj, part)
    return obj


def _worker(rank: int, fn: Callable, world_size: int, init_file: str, tmp_dir: str, args: tuple, errors,
            env: dict, timeout_s: float = 120.0, stack_file: str = "") -> None:
    os.environ.clear()
    os.environ.update(env)  # the caller's environment now, not the fork server's from when it started
    os.environ.update({"OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size)})
    import torch
    torch.set_num_threads(1)
    if stack_file:  # written from the signal handler in C: works while the rank is blocked in a collective
        faulthandler.register(STACK_SIGNAL, file=open(stack_file, "w"), all_threads=True)
    try:
        fn = _resolve(fn)  # before the rendezvous: an import failure is this rank's own error
        from .parallel.process_group import join
        join("gloo", rank, world_size, init_method=f"file://{init_file}", timeout_s=timeout_s)
        fn(rank, world_size, tmp_dir, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        os._exit(1)  # do not wait for peers that may be blocked in a collective
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_parallel(fn: Callable[..., Any], world_size: int, tmp_dir: str | os.PathLike | None = None,
                 args: tuple = (), deadline_s: float | None = None) -> None:
    """Run fn(rank, world_size, tmp_dir, *args) on world_size gloo processes; raise if any rank fails, or if
    the launch is not done within `deadline_s` seconds (naming every rank still running and where it waits).
    Without `tmp_dir` the workers share a temporary folder, removed when the launch ends (however it ends)."""
    if tmp_dir is not None:
        return _run_parallel(fn, world_size, Path(tmp_dir), args, deadline_s)
    tmp = Path(tempfile.mkdtemp(prefix="megalite-"))
    try:
        return _run_parallel(fn, world_size, tmp, args, deadline_s)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run_parallel(fn, world_size: int, tmp: Path, args: tuple, deadline_s: float | None) -> None:
    tmp.mkdir(parents=True, exist_ok=True)
    init_file = tmp / f"rendezvous-{os.getpid()}-{id(fn)}"
    if init_file.exists():
        init_file.unlink()
    if deadline_s is None:
        deadline_s = float(os.environ.get("MEGALITE_TEST_DEADLINE_S", DEADLINE_S))
    stacks = [tmp / f"stacks-{os.getpid()}-{id(fn)}-rank{r}.txt" for r in range(world_size)]
    ctx = _context()
    errors = ctx.SimpleQueue()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, _by_name(fn), world_size, str(init_file), str(tmp), args, errors, env,
                                               deadline_s + 30.0, str(stacks[r])))
             for r in range(world_size)]
    for p in procs:
        p.start()
    failed = None
    alive = list(procs)
    end = time.monotonic() + deadline_s
    while alive:  # wait on all sentinels; once one rank fails, the others may hang in a collective
        if not mp_connection.wait([p.sentinel for p in alive], timeout=max(0.0, end - time.monotonic())):
            _past_deadline(fn, world_size, deadline_s, procs, alive, stacks)
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
    for f in stacks:
        f.unlink(missing_ok=True)
    if not errors.empty():
        rank, tb = errors.get()
        raise RankFailed(f"rank {rank} of {world_size} failed:\n{tb}")
    if failed is not None:
        raise RankFailed(f"a rank exited with code {failed.exitcode} without a Python error (killed by a signal "
                         f"or the operating system, or crashed in native code)")


def _past_deadline(fn, world_size: int, deadline_s: float, procs: list, alive: list, stacks: list) -> None:
    """Every rank still running dumps its stacks; all are killed; RankFailed names each and where it waits."""
    for p in alive:
        os.kill(p.pid, STACK_SIGNAL)
    time.sleep(1.0)  # faulthandler writes from the signal handler at once; give the files a moment
    for p in alive:
        p.kill()
        p.join()
    lines = []
    for p in alive:
        r = procs.index(p)
        dump = stacks[r].read_text() if stacks[r].exists() else ""
        lines.append(f"rank {r} waits in {_where(dump)}")
        lines.append(_indent(_main_stack(dump)))
    for f in stacks:  # the finished ranks' (empty) files too
        f.unlink(missing_ok=True)
    raise RankFailed(f"{getattr(fn, '__qualname__', fn)}: {len(alive)} of {world_size} ranks still running after "
                     f"the {deadline_s:g} s deadline (killed):\n" + "\n".join(lines))


_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


def _main_stack(dump: str) -> str:
    """The main thread's frames of a faulthandler dump (its last block: the thread that took the signal)."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump.strip())
    main = [b for b in blocks if b.startswith("Current thread")] or blocks
    return main[-1] if main else "(no stack dump)"


def _where(dump: str) -> str:
    """'recv (distributed_c10d.py:1234) <- recv_backward (pipeline.py:96) <- ...': the innermost frame, then
    the innermost frames of megalite and of the test (what the rank was doing when it stopped moving)."""
    frames = _FRAME.findall(_main_stack(dump))  # most recent call first
    if not frames:
        return "(no stack dump)"
    ours = [f for f in frames[1:] if "site-packages" not in f[0] and "/lib/python" not in f[0]][:5]
    return " <- ".join(f"{name} ({Path(path).name}:{line})" for path, line, name in [frames[0], *ours])


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def gather_full_model(named_params, grid) -> dict:
    """Reassemble every parameter's full global tensor on every rank (tests only: holds the whole model).

    Reads each parameter's partition tag: tp slices are all-gathered over tp and concatenated along the
    split dim (padding dropped); pipeline stages exchange their parameters over the model-parallel group.
    """
    import torch
    from .parallel.agree import everyone
    from .parallel.partition import partition_of, tp_replicas, valid_view
    mine = {}
    for name, p in named_params:
        part = partition_of(p)
        if part.tied_to:
            continue
        local = valid_view(p.detach(), part, grid.tp.rank, grid.tp.size).cpu()
        if part.dim is not None and grid.tp.active:
            pieces = everyone(local, grid, grid.tp)
            local = torch.cat(pieces[::tp_replicas(part, grid.tp.size)], dim=part.dim)  # one per shared piece
        mine[name] = local
    if grid.mp.active:
        for d in everyone(mine, grid, grid.mp):
            mine.update(d)
    return mine


# ---------------------------------------------------------------- checkpoint round trips
def full_state(ckpt) -> dict:
    """Every model and optimizer tensor of a checkpoint, whole, by global name (reads the manifest only)."""
    from .checkpoint import manifest as mf
    from .checkpoint.tree import resolve
    from .parallel.partition import Box
    from .checkpoint.read import SliceReader
    step = resolve(ckpt)
    man = mf.read(step)
    reader = SliceReader(step, man)
    return {f"{'model' if e.kind == 'model' else 'optimizer_state'}/{e.name}": reader.read(e, Box.whole(e.shape))
            for e in man.tensors()}


def assert_round_trip(tmp_dir, save_layout: tuple, load_layout: tuple, *, model=None, optimizer=None,
                      train_step=None, steps: int = 1, zero1: tuple = (False, False),
                      data_path: str | None = None) -> None:
    """Train `steps` steps at save_layout (tp, pp, dp[, cp]), save a checkpoint, load it into a fresh model and
    optimizer at load_layout, save again, and assert that every tensor (parameters and optimizer state), the
    optimizer's scalars and hyperparameters, the step and the data position are bitwise what was saved.

    Your own model: `model(grid)` builds this rank's part of it (a plain nn.Module built from the same seed on
    every rank, with weights split by `megalite.parallel.partition.shard(param, dim, grid.tp)`) and
    `optimizer(module, grid)` its optimizer (any torch.optim optimizer, or megalite's ShardedAdamW). Both are
    module-level functions (or functools.partial of one): the worker processes receive them by reference.
    `train_step(module, optimizer, grid, step)` runs one step of yours; without it each parameter gets a
    gradient drawn from (its global name, the step) and the optimizer steps, which fills every state tensor.

    megalite's GPT: leave `model` out (or pass a dict of [model] fields); it trains real `megalite train` steps
    on a small corpus written in tmp_dir (or `data_path`) with megalite's AdamW, ZeRO-1 per phase from `zero1`.

        def test_tp2_to_pp2(tmp_path):
            assert_round_trip(tmp_path, save_layout=(2, 1, 1), load_layout=(1, 2, 1))

    The two launches (`run_parallel`) share the checkpoint through tmp_dir/checkpoint and write the second save
    to tmp_dir/resaved; each rendezvouses in a folder of its own.
    """
    import torch
    tmp = Path(tmp_dir)
    if model is None or isinstance(model, dict):
        case = _GPTCase(tmp, model, data_path, steps, zero1)
    else:
        if optimizer is None:
            raise TypeError("assert_round_trip: give `optimizer` (module, grid) -> optimizer with your `model`")
        case = _UserCase(model, optimizer, train_step)
    ckpt, resaved = tmp / "checkpoint", tmp / "resaved"
    from .parallel.grid import Layout
    for phase, layout in (("save", save_layout), ("load", load_layout)):
        run_parallel(_round_trip_worker, Layout(*layout).world_size, tmp / f"rendezvous-{phase}",
                     args=(case, tuple(layout), phase, str(ckpt), str(resaved), steps))
    before, after = full_state(ckpt), full_state(resaved)
    assert before.keys() == after.keys(), \
        f"tensor names differ after {save_layout} -> {load_layout}: {sorted(before.keys() ^ after.keys())[:5]}"
    for name in before:
        if not torch.equal(before[name], after[name]):
            diff = (before[name] - after[name]).abs().max().item()
            raise AssertionError(f"{name}: not bitwise equal after {save_layout} -> {load_layout} "
                                 f"(max abs diff {diff:.3g})")
    a, b = _sections(ckpt), _sections(resaved)
    for key in a:
        assert a[key] == b[key], f"manifest '{key}' differs after {save_layout} -> {load_layout}: {a[key]} != {b[key]}"


def _sections(ckpt) -> dict:
    """What a checkpoint says besides its tensors, which a round trip keeps too."""
    from .checkpoint import manifest as mf
    from .checkpoint.tree import resolve
    man = mf.read(resolve(ckpt))
    return {"step": man.step, "tokens_seen": man.tokens_seen, "optimizer": man.optimizer, "data": man.data,
            "client_state": man.client_state, "scheduler": man.scheduler}


def _round_trip_worker(rank, world_size, tmp_dir, case, layout, phase, ckpt, resaved, steps):
    from .checkpoint import load_checkpoint, save_checkpoint
    from .parallel.grid import Layout, ParallelGrid
    grid = ParallelGrid.create(Layout(*layout))
    module, opt = case.build(grid, phase)
    if phase == "save":
        for step in range(steps):
            case.train_step(module, opt, grid, step)
        save_checkpoint(ckpt, steps, module, opt, grid, **case.state())
    else:
        info = load_checkpoint(ckpt, module, opt, grid, **case.load_args())
        save_checkpoint(resaved, info.step, module, opt, grid,
                        **{**case.state(), "tokens_seen": info.tokens_seen, "data_state": info.data})


class _UserCase:
    """A round trip of your module and optimizer (sent to each worker; see assert_round_trip)."""

    def __init__(self, model, optimizer, train_step=None):
        for what, fn in (("model", model), ("optimizer", optimizer), ("train_step", train_step)):
            _check_picklable(what, fn)
        self.model, self.optimizer, self.step_fn = model, optimizer, train_step

    def build(self, grid, phase: str):
        module = self.model(grid)
        return module, self.optimizer(module, grid)

    def train_step(self, module, opt, grid, step: int) -> None:
        if self.step_fn is not None:
            return self.step_fn(module, opt, grid, step)
        import torch
        from .parallel.partition import init_local, partition_of
        named = module.global_parameters() if hasattr(module, "global_parameters") else module.named_parameters()
        for name, p in named:  # the same gradient for a parameter on every dp rank; a tp rank gets its slice
            p.grad = init_local(name, partition_of(p), "normal", 1 + step, 1.0, grid.tp.rank, grid.tp.size).to(p)
        if isinstance(opt, torch.optim.Optimizer):
            opt.step()
        else:  # megalite's ShardedAdamW takes the learning rate per step
            opt.step(1e-2)

    def state(self) -> dict:
        return {}

    def load_args(self) -> dict:
        return {}


def _check_picklable(what: str, fn) -> None:
    import pickle
    if fn is None:
        return
    try:
        pickle.dumps(fn)
    except (pickle.PicklingError, AttributeError, TypeError):
        raise TypeError(f"assert_round_trip: `{what}` ({getattr(fn, '__qualname__', fn)!r}) must be a module-level "
                        f"function or a functools.partial of one: the worker processes receive it by reference, "
                        f"and a lambda or a nested function cannot be sent") from None


class _GPTCase:
    """megalite's GPT trained by `megalite train`'s own steps: the convenience form of assert_round_trip."""

    def __init__(self, tmp: Path, model: dict | None, data_path: str | None, steps: int, zero1: tuple):
        from .data import prepare
        if data_path is None:
            src = tmp / "corpus.txt"
            src.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(2000)))
            data_path = str(tmp / "tokens.bin")
            prepare([src], data_path, log=lambda *a: None)
        self.base = {"model": model or {"n_layer": 4, "n_head": 4, "n_embd": 32, "block_size": 16},
                     "train": {"global_batch_size": 8, "micro_batch_size": 2, "steps": steps,
                               "out_dir": str(tmp / "run")},
                     "data": {"path": data_path}}
        self.zero1, self.cfg, self.tr = zero1, None, None

    def build(self, grid, phase: str):
        from .config import Config
        from .parallel.process_group import init_distributed
        from .run.train import build
        lay = grid.layout
        self.cfg = Config.from_dict({**self.base, "parallel": {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "cp": lay.cp,
                                                               "zero1": self.zero1[phase == "load"]}})
        device, _ = init_distributed()
        self.tr = build(self.cfg, grid, device)
        return self.tr.model, self.tr.optimizer

    def train_step(self, module, opt, grid, step: int) -> None:
        from .run.train import train_step
        train_step(self.tr)

    def state(self) -> dict:
        return {"config": self.cfg.to_dict(), "tokens_seen": self.tr.tokens_seen,
                "data_state": self.tr.sampler.state_dict()}

    def load_args(self) -> dict:
        return {"model_config": self.cfg.to_dict()["model"]}
