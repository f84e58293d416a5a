"""Separate hosts on one machine: network namespaces on a bridge ("the internet"), optionally behind NAT routers.

Only addresses inside namespaces created here are used (10.77.0.0/24 on the bridge, 10.78.N.0/24 behind router
N). `Internet.close()` deletes every namespace it made (their veths, routes and iptables rules go with them),
also when a test fails; `available()` says why a machine cannot run these tests (not root, no `ip`/`iptables`).
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from dataclasses import dataclass

_COUNTER = itertools.count()
LEFTOVER_EXIT_S = 5.0
"""How long the processes left in a namespace at close may take to exit on their own before they are killed: torch's
shared-memory manager of each island there removes the island's /dev/shm segments only once the island has exited,
3.4 s after its last client exits; killed at once it left them behind (tens of MB per island in every
restart_link.py run)."""


def _let_finish(pids: list[str], timeout: float) -> None:
    """Wait up to `timeout` for the processes `pids` to exit."""
    import psutil

    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(int(pid)))
        except (ValueError, psutil.Error):
            continue
    psutil.wait_procs(processes, timeout=timeout)


def _run(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(command, check=check, capture_output=True, text=True)


def available() -> str | None:
    """None when this machine can create namespaces, NATs and shaped links; else the reason it cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install -y iproute2 iptables)"
    name = f"p2pd-probe-{os.getpid()}"
    probe = _run("ip", "netns", "add", name, check=False)
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.strip()}"
    _run("ip", "netns", "del", name, check=False)
    return None


@dataclass(frozen=True)
class Host:
    """A machine: its namespace and the address other hosts see (the router's WAN address behind a NAT)."""

    namespace: str
    address: str
    """This host's own address."""
    public_address: str
    """Where the internet sees it from: its address, or its NAT router's."""

    @property
    def prefix(self) -> list[str]:
        """Command prefix that runs a program on this host."""
        return ["ip", "netns", "exec", self.namespace]

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run a command on this host."""
        return _run(*self.prefix, *command, check=check)


class Internet:
    """A switch namespace with a bridge; public hosts plug into it, NAT'd hosts sit behind their own router."""

    def __init__(self) -> None:
        self.tag = f"{os.getpid() % 10000}{next(_COUNTER)}"
        self.namespaces: list[str] = []
        self.switch = self._namespace("sw")
        _run("ip", "netns", "exec", self.switch, "ip", "link", "add", "br0", "type", "bridge")
        _run("ip", "netns", "exec", self.switch, "ip", "link", "set", "br0", "up")
        self._next_public = itertools.count(1)
        self._next_lan = itertools.count(1)

    def _namespace(self, role: str) -> str:
        name = f"pd{self.tag}{role}"
        _run("ip", "netns", "add", name)
        self.namespaces.append(name)
        _run("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        return name

    def _plug(self, namespace: str, device: str, address: str) -> None:
        """A veth from `namespace` (named `device`, with `address`/24) into the bridge."""
        peer = f"v{self.tag}{len(self.namespaces)}{device}"[:15]
        _run(
            "ip", "link", "add", device, "netns", namespace, "type", "veth", "peer", "name", peer, "netns", self.switch
        )
        _run("ip", "netns", "exec", self.switch, "ip", "link", "set", peer, "master", "br0", "up")
        _run("ip", "netns", "exec", namespace, "ip", "addr", "add", f"{address}/24", "dev", device)
        _run("ip", "netns", "exec", namespace, "ip", "link", "set", device, "up")

    def public_host(self, role: str) -> Host:
        """A host with an address on the internet itself."""
        namespace = self._namespace(role)
        address = f"10.77.0.{next(self._next_public)}"
        self._plug(namespace, "eth0", address)
        return Host(namespace, address, address)

    def nat_host(self, role: str) -> Host:
        """A host behind its own NAT router: it can dial out, nothing from outside can dial in."""
        lan = next(self._next_lan)
        router = self._namespace(f"{role}r")
        wan = f"10.77.0.{100 + lan}"
        self._plug(router, "wan", wan)
        host = self._namespace(role)
        inside, gateway = f"10.78.{lan}.2", f"10.78.{lan}.1"
        _run("ip", "link", "add", "lan", "netns", router, "type", "veth", "peer", "name", "eth0", "netns", host)
        _run("ip", "netns", "exec", router, "ip", "addr", "add", f"{gateway}/24", "dev", "lan")
        _run("ip", "netns", "exec", router, "ip", "link", "set", "lan", "up")
        _run("ip", "netns", "exec", host, "ip", "addr", "add", f"{inside}/24", "dev", "eth0")
        _run("ip", "netns", "exec", host, "ip", "link", "set", "eth0", "up")
        _run("ip", "netns", "exec", host, "ip", "route", "add", "default", "via", gateway)
        rules = [
            ["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"],
            ["iptables", "-t", "nat", "-A", "POSTROUTING", "-s", f"10.78.{lan}.0/24", "-o", "wan", "-j", "MASQUERADE"],
            ["iptables", "-A", "FORWARD", "-i", "wan", "-m", "conntrack", "!", "--ctstate", "ESTABLISHED,RELATED"]
            + ["-j", "DROP"],
        ]
        for rule in rules:
            _run("ip", "netns", "exec", router, *rule)
        return Host(host, inside, wan)

    def shape(
        self, host: Host, rate_mbit: float, device: str = "eth0", burst_kb: int = 64, latency_ms: int = 400
    ) -> None:
        """Limit what `host` sends on `device` to `rate_mbit` (tc tbf; the burst stays above the MTU).

        Above ~100 Mbit/s the bucket must also hold one kernel tick of traffic (rate / HZ), or tbf caps below rate.
        """
        host.run(
            "tc",
            "qdisc",
            "add",
            "dev",
            device,
            "root",
            "tbf",
            "rate",
            f"{rate_mbit}mbit",
            "burst",
            f"{burst_kb}kb",
            "latency",
            f"{latency_ms}ms",
        )

    def sent_bytes(self, host: Host, device: str = "eth0") -> int:
        """Bytes `host` has sent on `device` (Ethernet frames, headers included)."""
        return int(host.run("cat", f"/sys/class/net/{device}/statistics/tx_bytes").stdout)

    def close(self) -> None:
        """Delete every namespace this internet made (their links, routes and rules go with them)."""
        leftovers = [_run("ip", "netns", "pids", name, check=False).stdout.split() for name in self.namespaces]
        _let_finish([pid for pids in leftovers for pid in pids], LEFTOVER_EXIT_S)
        for namespace in reversed(self.namespaces):
            for pid in _run("ip", "netns", "pids", namespace, check=False).stdout.split():
                _run("kill", "-9", pid, check=False)
            _run("ip", "netns", "del", namespace, check=False)
        self.namespaces.clear()

    def __enter__(self) -> Internet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
