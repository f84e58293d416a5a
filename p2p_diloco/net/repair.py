"""The averaged parts a reducer sends in one round, serialized once and kept for a member whose reply stream broke.

A reply stream can end early in transit (measured: 1 in 24 rounds of 4 islands on 100 Mbit/s links, and on
loopback) although the reducer received every part and reduced them all. Without a repair that member alone
discards the round while the others apply it, and its anchor leaves the swarm's lineage until a resync. Every
member receives the same bits from a reducer, so the reducer can send the rest again over a fresh stream.
Keeping one serialized copy per part also spares the reducer serializing the same average once per sender.

A member asks right after its reply stream ends, which may be after the reducer's own round is over: a reducer that
exits then (the run's last round, a member of a test group) stays `REPAIR_WINDOW_S` for that question first. Without
it, about 1 in 3 runs of test_allreduce.py lost the round at the member that asked (the reducer was gone).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Sequence

import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

REPAIR_WINDOW_S = 2.0
"""How long after its round a reducer that is shutting down still answers a member that lost parts."""


class ServedParts:
    """One reducer's averaged parts of one round, by part index, and in wire form by part index and compression."""

    def __init__(self, group_id: bytes, senders: Sequence[PeerID], num_parts: int) -> None:
        self.group_id, self.senders, self.num_parts = group_id, tuple(senders), num_parts
        self._averaged: dict[int, torch.Tensor] = {}
        self._parts: dict[tuple[int, int], asyncio.Future] = {}
        self._new_part = asyncio.Condition()
        self.ended_at: float | None = None  # time.monotonic() when this member's round ended
        self._resending = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def end_round(self) -> None:
        """Note that this member's round is over (members may still ask for parts for `REPAIR_WINDOW_S`)."""
        self.ended_at = time.monotonic()

    async def linger(self, budget: float) -> None:
        """Before a shutdown: stay (at most `budget` s) until the repair window has passed and no resend is under
        way."""
        deadline = time.monotonic() + budget
        if self.ended_at is not None:
            window_left = min(self.ended_at + REPAIR_WINDOW_S, deadline) - time.monotonic()
            if window_left > 0:
                await asyncio.sleep(window_left)
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            pass

    async def record(self, index: int, averaged: torch.Tensor) -> None:
        """Keep averaged part `index` (as sent over a direct lane) for a member that may ask for it again."""
        if index not in self._averaged:
            self._averaged[index] = averaged
            async with self._new_part:
                self._new_part.notify_all()

    async def serialized(self, index: int, averaged: torch.Tensor, compression: int) -> runtime_pb2.Tensor:
        """Part `index` in wire form: serialized by the first stream that sends it, shared with the others."""
        await self.record(index, averaged)
        key = (index, compression)
        if key not in self._parts:
            # An executor future runs to its end even if the stream that started it is cancelled meanwhile.
            loop = asyncio.get_running_loop()
            self._parts[key] = loop.run_in_executor(None, serialize_torch_tensor, averaged, compression)
        return await asyncio.shield(self._parts[key])

    async def resend(self, first: int, compression: int, timeout: float) -> AsyncIterator[runtime_pb2.Tensor]:
        """Parts `first`.. in order, each waited for at most `timeout` s if the round has not produced it yet."""
        self._resending += 1
        self._idle.clear()
        try:
            for index in range(first, self.num_parts):
                async with self._new_part:
                    await asyncio.wait_for(
                        self._new_part.wait_for(lambda index=index: index in self._averaged), timeout
                    )
                yield await self.serialized(index, self._averaged[index], compression)
        finally:
            self._resending -= 1
            if not self._resending:
                self._idle.set()


def valid_first_part(value: float, num_parts: int) -> int | None:
    """The first missing part a peer asks for, or None when it is not a part index of this round."""
    if math.isfinite(value) and value == int(value) and 0 <= value < num_parts:
        return int(value)
    return None
