"""Bytes an island's libp2p daemon really moves over TCP, read from the kernel's per-socket counters.

The payload counters of the all-reduce miss libp2p framing, encryption, DHT and matchmaking traffic; the kernel
counts all of it. `ss` reports `bytes_sent` / `bytes_received` for every TCP socket with its owning process,
so the island sums the sockets of its own p2pd daemon. Counters of a socket vanish when it closes, so increments
are accumulated per socket while it lives; traffic of a connection opened and closed between two reads is missed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable

import psutil

from p2p_diloco.timeouts import SOCKET_STATS_S

_SOCKET = re.compile(r"^\S+\s+\S+\s+\S+\s+(\S+)\s+(\S+)\s+users:\(\(.*?pid=(\d+)")
_COUNTER = re.compile(r"\bbytes_(sent|received):(\d+)")


def parse_ss(output: str) -> dict[tuple[str, str, int], tuple[int, int]]:
    """(local, remote, pid) -> (bytes sent, bytes received) from `ss -tinpH` output."""
    sockets: dict[tuple[str, str, int], tuple[int, int]] = {}
    key = None
    for line in output.splitlines():
        if (match := _SOCKET.match(line)) is not None:
            key = (match.group(1), match.group(2), int(match.group(3)))
            sockets[key] = (0, 0)
        elif key is not None and line[:1].isspace():
            counters = dict((name, int(value)) for name, value in _COUNTER.findall(line))
            sockets[key] = (counters.get("sent", 0), counters.get("received", 0))
    return sockets


class TransportMeter:
    """Cumulative TCP bytes sent and received by the p2pd daemons under this process, plus its direct lanes'."""

    def __init__(self, root_pid: int | None = None, lanes: Callable[[], tuple[float, float]] | None = None) -> None:
        self.root_pid = os.getpid() if root_pid is None else root_pid
        self.lanes = lanes  # direct lanes live one round each: they count their own bytes when they close
        self.available = shutil.which("ss") is not None
        self._last: dict[tuple[str, str, int], tuple[int, int]] = {}
        self.sent = 0
        self.received = 0

    def _daemon_pids(self) -> set[int]:
        try:
            children = psutil.Process(self.root_pid).children(recursive=True)
        except psutil.Error:
            return set()
        pids = set()
        for child in children:
            try:
                if child.name() == "p2pd":
                    pids.add(child.pid)
            except psutil.Error:
                continue
        return pids

    def read(self) -> tuple[int, int] | None:
        """(bytes sent, bytes received) so far, or None where `ss` is not available."""
        if not self.available:
            return None
        pids = self._daemon_pids()
        try:
            output = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=SOCKET_STATS_S).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        current = {key: value for key, value in parse_ss(output).items() if key[2] in pids}
        for key, (sent, received) in current.items():
            last_sent, last_received = self._last.get(key, (0, 0))
            self.sent += max(0, sent - last_sent)
            self.received += max(0, received - last_received)
        self._last = current
        lane_sent, lane_received = self.lanes() if self.lanes is not None else (0, 0)
        return self.sent + int(lane_sent), self.received + int(lane_received)
