"""Joining and leaving the torchrun job: the process group's lifecycle, apart from the recipe that uses it.

    init_distributed                      join the job torchrun started (or make a world of one)
    leave_distributed                     leave it before exit: every group destroyed, its threads joined
    agree_settings(settings, error)       start-up: every rank runs the same settings, or every rank stops
    agree(fn, grid)                       run a phase on every rank; a user error on any rank stops them all
    world_size_from_env()                 the world torchrun says this process is part of

The grid (`grid.py`) builds the per-axis groups on top of the default group joined here.
"""
from __future__ import annotations

import gc
import hashlib
import json
import os
import traceback
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ..base.errors import USER_ERRORS, MegaliteError, StartupError, one_line
from .grid import ParallelGrid


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(timeout_s: float = 1800) -> tuple[torch.device, str]:
    """Join the torchrun job (or make a world of one); nccl with one GPU per rank, else gloo."""
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend, store=_job_store(rank, world, timeout_s), rank=rank,
                                    world_size=world, timeout=timedelta(seconds=timeout_s))
        else:  # a plain `megalite train` without torchrun: a world of one
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timedelta(seconds=timeout_s))
    return device, backend


def leave_distributed(error: Optional[BaseException] = None) -> None:
    """End this process's part in the job while the interpreter is still whole: destroy every process group
    (the grid's groups, newest first, then the default one) and free them now (all that nothing else still
    holds), so that their gloo worker threads are joined here. Left to interpreter exit, a worker thread
    still releasing its last collective's tensors (an all_gather_object's, say) needs the GIL after
    finalization began; Python ends such a thread with pthread_exit, whose unwinding through C++ aborts the
    process ("terminate called without an active exception", exit -6 instead of 2). After an `error`: no
    barrier first (a peer may be gone), and the locals of the error's finished frames (the grid, the
    Trainer) are dropped so the groups can be freed; the traceback itself stays printable."""
    if not dist.is_initialized():
        return
    try:
        if error is None:
            dist.barrier()  # leave together: a rank that exits while peers still talk to it can abort them
    finally:
        dist.destroy_process_group()  # every group torch knows, newest first
        e, seen = error, set()
        while e is not None and id(e) not in seen:  # the error, what it came from, and so on
            seen.add(id(e))
            traceback.clear_frames(e.__traceback__)
            e = e.__cause__ or e.__context__
        gc.collect()  # the grid's groups sit in reference cycles (an exception's frames): freed and joined here


def _job_store(rank: int, world: int, timeout_s: float):
    """torchrun's store, under a prefix per restart attempt.

    After `torchrun --max-restarts` restarts the workers, they reuse the agent's store, which still holds
    the previous attempt's gloo addresses; without a fresh namespace the new ranks try to connect to dead
    peers ("Connection refused") or hang.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(host, port, world, is_master=rank == 0 and not agent_store,
                          timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    if not agent_store:  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0 hosts a new store every attempt
        return store  # (restart counts differ between a restarted agent and a replaced one: pytorch#135712)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"megalite/attempt-{attempt}", store)


def agree(fn, grid: ParallelGrid):
    """Run fn() on every rank; if a user error happens on any rank, every rank raises the lowest failing
    rank's error (marked shared, so only rank 0 prints it), instead of ranks dying one by one
    in different places. Anything else (a bug) keeps its own traceback.

    One all_gather_object over the grid's gloo group (`grid.cpu`) of each rank's (error type, message) or None.
    """
    result, err = None, None
    try:
        result = fn()
    except USER_ERRORS as e:
        err = e
    if grid.layout.world_size > 1:
        msgs = [None] * grid.layout.world_size
        dist.all_gather_object(msgs, None if err is None else (type(err).__name__, str(err)), group=grid.cpu)
        first = next((m for m in msgs if m is not None), None)
        if first is not None and err is None:
            err = StartupError(first[1])
    if err is not None:
        if isinstance(err, MegaliteError):
            err.everywhere()
        else:  # an OSError: say that every rank raises it
            err = StartupError(one_line(err))
        raise err
    return result


def agree_settings(settings: Optional[dict], error: Optional[BaseException] = None) -> None:
    """Start-up, on the default group (before the grid: a layout that differs between ranks would build
    different groups and hang): every rank must hold the same `settings` ({name: value as text}: the resolved
    config, the paths as each rank resolves them, the token file's identity). `settings` None: this rank's
    config did not even load (`error` says why; its config file is not the others'): every rank raises that
    error, naming the rank. Else any difference raises the same StartupError on every rank, one line naming the
    first field that differs and which ranks hold which value (every field that differs is counted). Then a
    user error of one rank's (`error`: its config failed validation) is raised by every rank. A world of one
    just raises its error.

    Cost: one all_gather_object of a digest per rank; the settings themselves travel only when they differ."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        digest = None if settings is None else hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
        mine = (digest, None if error is None else one_line(error))
        got = [None] * world
        dist.all_gather_object(got, mine)
        unloaded = next((r for r, (d, _) in enumerate(got) if d is None), None)
        if unloaded is not None and settings is not None:
            raise StartupError(f"rank {unloaded}: {got[unloaded][1]}")
        if settings is not None and len({d for d, _ in got}) > 1:
            tables = [None] * world
            dist.all_gather_object(tables, settings)
            raise StartupError(disagreement(tables))
        failed = next((r for r, (_, e) in enumerate(got) if e is not None), None)
        if error is None and failed is not None:
            raise StartupError(f"rank {failed}: {got[failed][1]}")
    if error is not None:
        raise error.everywhere() if isinstance(error, MegaliteError) else StartupError(one_line(error))


def disagreement(tables: list) -> str:
    """One line: the first field whose value differs between ranks' `tables` (rank order), who holds what, and
    how many other fields differ."""
    keys = list(dict.fromkeys(k for t in tables for k in t))
    differ = [k for k in keys if len({t.get(k) for t in tables}) > 1]
    first = differ[0]
    holders: dict = {}
    for rank, t in enumerate(tables):
        holders.setdefault(t.get(first, "(not set)"), []).append(rank)
    who = "; ".join(f"{_ranks(rs)} {'has' if len(rs) == 1 else 'have'} {_short(v)}" for v, rs in holders.items())
    more = f" (and {len(differ) - 1} more: {', '.join(differ[1:4])}{', ...' if len(differ) > 4 else ''})" \
        if len(differ) > 1 else ""
    return (f"ranks disagree on {first}: {who}{more}; every rank must run the same config, paths and token "
            f"file (a config file, an override or a working directory that differs between hosts?)")


def _ranks(rs: list) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2,5'; [3] -> 'rank 3'."""
    runs: list = []
    for r in rs:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)
    return f"{'rank' if len(rs) == 1 else 'ranks'} {text}"


def _short(v) -> str:
    """A value for the one line: at most 160 characters, elided in the middle (paths differ at the end)."""
    v = str(v)
    return v if len(v) <= 160 else v[:60] + "..." + v[-97:]
