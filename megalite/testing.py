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


# ---------------------------------------------------------------- checkpoint round trips
def _round_trip_worker(rank, world_size, tmp_dir, cfg_dict, phase, ckpt, steps):
    from .checkpoint import load_checkpoint, save_checkpoint
    from .config import Config
    from .parallel.grid import Layout, ParallelGrid
    from .train import build, init_distributed, train_step
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
    from .checkpoint.layout import Box, resolve
    from .checkpoint.reshard import SliceReader
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


# ---------------------------------------------------------------- simulated hosts (network namespaces)
SIM_PREFIX = "mlsim-"  # every namespace a SimCluster creates starts with this (and its creator's pid)


class SimUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no `ip`, a sandbox without CAP_NET_ADMIN)."""


def _ip(*args: str, check: bool = True):
    import subprocess
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode:
        raise SimUnavailable(f"`ip {' '.join(args)}` failed: {r.stderr.strip() or r.returncode}")
    return r


def _netns_pids(ns: str) -> list[int]:
    return [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]


def _remove_netns(ns: str) -> None:
    """SIGKILL whatever still runs inside `ns`, then delete it (its veth ends and bridge go with it)."""
    import signal as _signal
    for pid in _netns_pids(ns):
        try:
            os.kill(pid, _signal.SIGKILL)
        except ProcessLookupError:
            pass
    _ip("netns", "delete", ns, check=False)


def remove_leftover_hosts() -> list[str]:
    """Delete the namespaces of SimClusters whose creating process is gone (a killed test run); never
    anyone else's namespaces and never those of a cluster that is still running. Returns their names."""
    out = _ip("netns", "list", check=False).stdout.split("\n")
    removed = []
    for line in out:
        ns = line.split(" ")[0]
        if not ns.startswith(SIM_PREFIX):
            continue
        owner = ns[len(SIM_PREFIX):].split("-")[0]
        if owner.isdigit() and Path(f"/proc/{owner}").exists():
            continue
        _remove_netns(ns)
        removed.append(ns)
    return removed


class SimHost:
    """One simulated machine: a network namespace with one interface (`eth0`) and its own address."""

    def __init__(self, index: int, ns: str, addr: str):
        self.index, self.ns, self.addr, self.ifname = index, ns, addr, "eth0"

    def cmd(self, argv: list) -> list:
        """argv run inside this host's network namespace (same files, same users, its own network)."""
        return ["ip", "netns", "exec", self.ns, *map(str, argv)]

    def pids(self) -> list[int]:
        return _netns_pids(self.ns)

    def __repr__(self) -> str:
        return f"SimHost({self.index}, {self.ns}, {self.addr})"


class SimCluster:
    """N simulated hosts on this machine, as on a cluster: each host is a network namespace whose only
    interface `eth0` (a veth pair) is plugged into a bridge that lives in a namespace of its own (the
    switch). The subnet exists only inside these namespaces; this machine's own network never sees it.
    Files are shared (one filesystem, as a cluster's shared checkpoint folder).

        with SimCluster(2) as cluster:
            h0, h1 = cluster.hosts                 # h0.addr == "10.77.0.1", h1.addr == "10.77.0.2"
            subprocess.run(h1.cmd(["ping", "-c1", h0.addr]))
            cluster.lose(h1)                       # cable out, then every process on it SIGKILLed

    Always torn down on exit (processes still inside are killed); namespaces left by a killed test run
    are removed the next time a cluster is created (by name prefix and creator pid, see SIM_PREFIX).
    """

    def __init__(self, n_hosts: int = 2, subnet: str = "10.77.0"):
        self.n_hosts, self.subnet = n_hosts, subnet
        self.name = f"{SIM_PREFIX}{os.getpid()}-{id(self) % 10_000:04d}"
        self.switch = f"{self.name}-sw"
        self.hosts: list[SimHost] = []

    def __enter__(self) -> "SimCluster":
        import shutil as _shutil
        if os.geteuid() != 0 or _shutil.which("ip") is None:
            raise SimUnavailable("simulated hosts need root and the `ip` tool (iproute2)")
        remove_leftover_hosts()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def _create(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.n_hosts):
            host = SimHost(i, f"{self.name}-h{i}", f"{self.subnet}.{i + 1}")
            _ip("netns", "add", host.ns)
            self.hosts.append(host)
            port = f"port{i}"  # the switch's side of the cable; eth0 is created directly inside the host
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            _ip("-n", host.ns, "link", "set", "eth0", "up")
            _ip("-n", host.ns, "link", "set", "lo", "up")

    def torchrun(self, host: SimHost, args: list, nproc_per_node: int = 4, max_restarts: int = 0,
                 rdzv_port: int = 29400, rdzv_id: str = "sim") -> list:
        """The argv of one torchrun agent on `host`, as on a real cluster: the c10d rendezvous at host 0's
        address, this host's own address for the agent (`--local-addr`), gloo bound to its interface, and
        torch's rendezvous store not shared with the workers (see README, "Running on a cluster").
        `args` follow torchrun's, e.g. ["-m", "megalite", "train", ...]."""
        import sys
        env = [f"GLOO_SOCKET_IFNAME={host.ifname}", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"]
        return host.cmd(["env", *env, sys.executable, "-m", "torch.distributed.run",
                         "--nnodes", str(len(self.hosts)), "--nproc-per-node", str(nproc_per_node),
                         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.hosts[0].addr}:{rdzv_port}",
                         "--rdzv-id", rdzv_id, "--rdzv-conf", f"is_host={str(host.index == 0).lower()}",
                         "--local-addr", host.addr, f"--max-restarts={max_restarts}", *map(str, args)])

    def unplug(self, host: SimHost) -> None:
        """Pull the host's cable: its switch port goes down, so nothing it sends arrives and nothing
        sent to it is answered (no reset, no FIN: its peers see silence, as when a machine loses power)."""
        _ip("-n", self.switch, "link", "set", f"port{host.index}", "down")
        _ip("-n", host.ns, "link", "set", "eth0", "down")

    def plug(self, host: SimHost) -> None:
        """Put the cable back (a replacement machine at the same address)."""
        _ip("-n", host.ns, "link", "set", "eth0", "up")
        _ip("-n", self.switch, "link", "set", f"port{host.index}", "up")

    def lose(self, host: SimHost) -> list[int]:
        """The host vanishes: cable out first, then every process in its namespace SIGKILLed. Returns
        the pids killed."""
        import signal as _signal
        self.unplug(host)
        killed = host.pids()
        for pid in killed:
            try:
                os.kill(pid, _signal.SIGKILL)
            except ProcessLookupError:
                pass
        return killed

    def close(self) -> None:
        for host in self.hosts:
            _remove_netns(host.ns)
        _remove_netns(self.switch)
        self.hosts = []

    def __exit__(self, *exc) -> None:
        self.close()
