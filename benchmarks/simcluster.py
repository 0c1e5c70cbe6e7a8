"""Simulated hosts for multi-host tests: network namespaces on one Linux machine (needs root and `ip`).

Each host is a network namespace whose only interface `eth0` is a veth pair plugged into a bridge in a
namespace of its own; files are shared, as on a cluster's shared filesystem. `torchrun(host, ...)` gives the
command that starts one torchrun agent on a host; `lose(host)` pulls its cable and SIGKILLs everything on it.
Used by tests/test_cluster.py; nothing in megalite's core imports it.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

SIM_PREFIX = "mlsim-"  # every namespace a SimCluster creates starts with this (and its creator's pid)


class SimUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no `ip`, a sandbox without CAP_NET_ADMIN)."""


def _ip(*args: str, check: bool = True):
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
        torch's rendezvous store not shared with the workers (see docs/training.md, "Running on a cluster").
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
