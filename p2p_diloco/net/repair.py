"""The averaged parts a reducer sends in one round, serialized once and kept for a member whose reply stream broke.

A reply stream can end early in transit (measured: 1 in 24 rounds of 4 islands on 100 Mbit/s links, and on
loopback) although the reducer received every part and reduced them all. Without a repair that member alone
discards the round while the others apply it, and its anchor leaves the swarm's lineage until a resync. Every
member receives the same bits from a reducer, so the reducer can send the rest again over a fresh stream.
Keeping one serialized copy per part also spares the reducer serializing the same average once per sender.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Sequence

import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2


class ServedParts:
    """One reducer's averaged parts of one round, by part index, and in wire form by part index and compression."""

    def __init__(self, group_id: bytes, senders: Sequence[PeerID], num_parts: int) -> None:
        self.group_id, self.senders, self.num_parts = group_id, tuple(senders), num_parts
        self._averaged: dict[int, torch.Tensor] = {}
        self._parts: dict[tuple[int, int], asyncio.Future] = {}
        self._new_part = asyncio.Condition()

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
        for index in range(first, self.num_parts):
            async with self._new_part:
                await asyncio.wait_for(self._new_part.wait_for(lambda index=index: index in self._averaged), timeout)
            yield await self.serialized(index, self._averaged[index], compression)


def valid_first_part(value: float, num_parts: int) -> int | None:
    """The first missing part a peer asks for, or None when it is not a part index of this round."""
    if math.isfinite(value) and value == int(value) and 0 <= value < num_parts:
        return int(value)
    return None
