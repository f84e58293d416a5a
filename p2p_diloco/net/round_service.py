"""What an island's averager serves the members of the rounds it reduces, beside hivemind's handlers: tickets for
direct lanes (`p2p_diloco.net.direct`) and the averaged parts a member asks for again (`p2p_diloco.net.repair`)."""

from __future__ import annotations

import asyncio

# hivemind tells streaming handlers from unary ones by typing.AsyncIterator's name (not collections.abc's).
from typing import AsyncIterator  # noqa: UP035

from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import get_logger

from p2p_diloco.net.direct import DirectLanes
from p2p_diloco.net.repair import valid_first_part

logger = get_logger(__name__)


class RoundServiceMixin:
    """The lane and repair half of `PseudoGradientAverager` (which provides the attributes used here)."""

    def _lanes(self) -> DirectLanes | None:
        """This process's direct lanes (None when they are off)."""
        if self._lanes_wanted and self._direct_lanes is None:
            self._direct_lanes = DirectLanes(self._direct_port, self._uplink_mbit)
        return self._direct_lanes

    async def rpc_direct_ticket(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> averaging_pb2.DownloadData:
        """Hand a sender of a round this island reduces a one-time ticket for a direct lane (empty: use libp2p)."""
        lanes = self._lanes()
        if lanes is None or not self.gate.member(context.remote_id.to_base58()):
            return averaging_pb2.DownloadData()
        if request.group_id not in self._running_groups:  # the leader's word may reach us after a sender's
            await asyncio.wait_for(self._pending_groups_registered.wait(), self.next_chunk_timeout)
        future = self._running_groups.get(request.group_id)
        if future is None:
            return averaging_pb2.DownloadData()
        runner = await asyncio.wait_for(asyncio.shield(future), self.next_chunk_timeout)
        reduces = runner.tensor_part_reducer.num_parts > 0
        if not reduces or context.remote_id not in runner.sender_peer_ids:
            return averaging_pb2.DownloadData()
        maddrs = await self._p2p.get_visible_maddrs()
        sender_index = runner.sender_peer_ids.index(context.remote_id)
        # The sender has started (hivemind bans senders that have not within sender_timeout): a ticket, a TCP
        # connect and a hello take longer than the first message of a libp2p stream.
        runner.active_senders.add(context.remote_id)
        if len(runner.active_senders) == len(runner.sender_peer_ids):
            runner.all_senders_started.set()
        offer = await lanes.offer(runner, sender_index, maddrs, ttl=self._allreduce_timeout or self.next_chunk_timeout)
        if offer is not None:
            runner.expect_sender(context.remote_id, hosts=len(offer["hosts"]))
        return averaging_pb2.DownloadData(metadata=self.serializer.dumps(offer) if offer else b"")

    async def rpc_repair_parts(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Send a member of this island's latest round the averaged parts its reply stream lost."""
        served = self._served
        if served is None or request.group_id != served.group_id or context.remote_id not in served.senders:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        first = valid_first_part(request.weight, served.num_parts)  # `weight` carries the first missing part
        if first is None:
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        logger.info(f"sending {context.remote_id} parts {first}.. of its round again (its reply stream broke)")
        async for part in served.resend(first, request.tensor_part.compression, self.next_chunk_timeout):
            self.byte_counters.add(sent=part.ByteSize())
            yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=part)
