"""Joining and leaving the torchrun job: the process group's lifecycle, apart from the recipe that uses it.

    joined(timeout_s)                     join and leave as one pair: `with joined(...) as device:` (a group
                                          that was already joined is the caller's, left alone)
    init_distributed                      join the job torchrun started (or make a world of one)
    join(backend, rank, world, ...)       join with an explicit rendezvous (a store, a file://, a world of one)
    leave_distributed                     leave it before exit: every group destroyed, its threads joined
    world_size_from_env()                 the world torchrun says this process is part of

The grid (`grid.py`) builds the per-axis groups on top of the default group joined here; agreeing across
ranks (start-up settings, a phase's user errors, a checkpoint's problems) is agree.py's.
"""
from __future__ import annotations

import contextlib
import gc
import os
import signal
import traceback
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ..base.errors import PeerLostError


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
            join(backend, rank, world, store=_job_store(rank, world, timeout_s), timeout_s=timeout_s)
        else:  # a plain `megalite train` without torchrun: a world of one
            join(backend, timeout_s=timeout_s)
    return device, backend


def join(backend: str, rank: int = 0, world: int = 1, *, store=None, init_method: Optional[str] = None,
         timeout_s: float = 1800) -> None:
    """Join the default process group: through `store` (torchrun's job, see init_distributed), an `init_method`
    (megalite.testing's workers rendezvous in a file://), or, with neither, as a world of one on an in-memory
    store (a run without torchrun, `gpu-check`'s single process). Leave with leave_distributed."""
    if store is None and init_method is None:
        store = dist.HashStore()
    dist.init_process_group(backend, store=store, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


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


@contextlib.contextmanager
def joined(timeout_s: float = 1800):
    """Join the job for the body (yields the device) and leave it after, as one pair: after an error without a
    final barrier (a peer may be gone: a barrier could wait the whole timeout) and with SIGTERM ignored (torchrun
    SIGTERMs the workers still running as soon as one has exited; ignoring it lets each rank finish with its own
    exit code). A process group that was joined before the body is its caller's: it is not left here."""
    if dist.is_initialized():
        yield init_distributed(timeout_s)[0]
        return
    device, _ = init_distributed(timeout_s)
    try:
        yield device
    except BaseException as e:
        if world_size_from_env() > 1:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        leave_distributed(error=e)
        lost = peer_lost(e)
        if lost:  # the survivor of a dead rank: one line, not the backend's traceback (the dead rank says why)
            raise PeerLostError(f"another rank of the job is gone ({lost}); this rank stops too (the launcher's "
                                f"summary names the rank that ended first)") from None
        raise
    leave_distributed()


# what each backend says when the other end of a connection is gone; peer_lost reads these and nothing else
GLOO_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")  # gloo tcp/pair.cc
NCCL_GONE = ("ncclRemoteError", "remote process exited or there was a network error",  # ncclGetErrorString
             "Watchdog caught collective operation timeout",  # ProcessGroupNCCL's watchdog: a peer that never came
             "NCCL communicator was aborted",  # the watchdog's abort, seen by the rank's next collective
             "Connection closed by peer", "Connection reset by peer")  # NCCL's socket transport (net_socket)


def peer_lost(e: BaseException) -> Optional[str]:
    """'<backend>: <its words>' when `e` is a failed collective whose backend says another rank is gone, else None
    (a bug keeps its traceback). Read: gloo's socket words in gloo's error; NCCL's remote-error, watchdog-timeout
    and abort words in an error that names NCCL (ProcessGroupNCCL, `NCCL error`); torch's c10d types where this
    torch has them: a DistNetworkError is always a connection lost, a DistBackendError counts when it carries one
    of those words (not an NCCL error of this rank's own: `unhandled cuda error`, `invalid usage`)."""
    if not isinstance(e, RuntimeError):
        return None
    text = str(e)
    network = isinstance(e, getattr(dist, "DistNetworkError", ()))
    backend_error = isinstance(e, getattr(dist, "DistBackendError", ()))
    if "nccl" in text.lower():
        said = next((w for w in NCCL_GONE if w in text), None)
        return f"NCCL: {said}" if said else f"c10d network error: {_first_line(text)}" if network else None
    said = next((w for w in GLOO_GONE if w in text), None)
    if said is not None and ("gloo" in text or network or backend_error):
        return f"gloo: {said}" if "gloo" in text else f"c10d: {said}"
    return f"c10d network error: {_first_line(text)}" if network else None


def _first_line(text: str, width: int = 160) -> str:
    line = next((s.strip() for s in text.splitlines() if s.strip()), "no message")
    return line if len(line) <= width else line[:width - 3] + "..."


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
