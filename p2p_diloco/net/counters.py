"""What an averager process moved: payload and wire byte counters readable from the host process, and a pacer that
stands in for a slow link."""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing as mp
import os
import time
from typing import Any


class ByteCounters:
    """Payload bytes sent and received by an averager process (and reply streams it mended), readable from the
    host process."""

    def __init__(self) -> None:
        self._sent = mp.Value(ctypes.c_double, 0.0)
        self._received = mp.Value(ctypes.c_double, 0.0)
        self._repaired = mp.Value(ctypes.c_long, 0)
        self._lanes = mp.Value(ctypes.c_long, 0)
        self._wire_sent = mp.Value(ctypes.c_double, 0.0)
        self._wire_received = mp.Value(ctypes.c_double, 0.0)

    def count_lane(self) -> None:
        """Count one reducer this process sent its parts to over a direct lane."""
        _increment(self._lanes, 1)

    def lanes(self) -> int:
        """Direct lanes opened as a sender so far."""
        return self._lanes.value

    def add_wire(self, sent: float, received: float) -> None:
        """Count the bytes a closed direct lane moved over TCP (frames, tags and hello included)."""
        _increment(self._wire_sent, sent)
        _increment(self._wire_received, received)

    def wire(self) -> tuple[float, float]:
        """(bytes sent, bytes received) over TCP by direct lanes so far (libp2p's own are counted by `ss`)."""
        return self._wire_sent.value, self._wire_received.value

    def count_repair(self) -> None:
        """Count one broken reply stream whose missing parts arrived over a new one."""
        _increment(self._repaired, 1)

    def repairs(self) -> int:
        """Broken reply streams mended so far."""
        return self._repaired.value

    def add(self, sent: float = 0.0, received: float = 0.0) -> None:
        """Count bytes that went out or came in."""
        _increment(self._sent, sent)
        _increment(self._received, received)

    def read(self) -> tuple[float, float]:
        """(bytes sent, bytes received) so far."""
        return self._sent.value, self._received.value


def _increment(counter: Any, amount: float) -> None:
    """Add to a shared counter under its lock (the averager process and its host both touch it)."""
    with counter.get_lock():
        counter.value += amount


class LinkLimiter:
    """Paces the bytes an averager process sends to a fixed rate: a stand-in for a slow link where `tc` is not
    allowed. Set P2P_DILOCO_LINK_MBIT in the island's environment to enable it (payload only, not DHT traffic)."""

    def __init__(self, mbit: float) -> None:
        self.bytes_per_s = mbit * 1e6 / 8
        self.free_at = 0.0

    @classmethod
    def from_env(cls) -> LinkLimiter | None:
        """The limiter P2P_DILOCO_LINK_MBIT asks for, if any."""
        value = os.environ.get("P2P_DILOCO_LINK_MBIT")
        return cls(float(value)) if value else None

    async def send(self, size: int) -> None:
        """Wait until `size` more bytes fit through the link."""
        now = time.monotonic()
        self.free_at = max(now, self.free_at) + size / self.bytes_per_s
        await asyncio.sleep(self.free_at - now)
