"""One all-reduce's parts over a direct lane (`p2p_diloco.net.direct`): the sender's side and the reducer's side.

The same rules hold as over libp2p streams: a reducer bans a sender whose parts stop before the last one (so every
member discards the round), a sender that loses reply parts asks the reducer for them again over libp2p
(`rpc_repair_parts`), and every member receives the same bits from a reducer. Plain fp32 parts travel as their raw
little-endian values, received into fresh buffers and used in place; compressed parts as hivemind's serialized
`runtime_pb2.Tensor`, decoded off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Iterator

import torch
from hivemind.averaging.partition import AllreduceException, BannedException
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MSGPackSerializer, get_logger

from p2p_diloco.net.codecs import decode_into
from p2p_diloco.net.direct import (
    CONNECT_S,
    HELLO_S,
    PROTOBUF,
    RAW_FP32,
    DirectLanes,
    Lane,
    LaneError,
    LaneSilent,
)

logger = get_logger(__name__)

PROTOBUF_SLACK = 4096
"""Bytes a compressed part may exceed its raw size by (a codec's header on a tiny part)."""
READ_AHEAD = 2
"""Parts a reducer reads from a lane ahead of the one it is reducing."""
TICKET_S = 5.0
"""Longest wait for a reducer's ticket: it may still be entering the round, which took an island of 0.4 cores more
than 3 s (benchmarks/chaos.py, a clean run) where a lane that is open is given up on after SILENCE_S."""
TICKET_MARGIN_S = 0.5
"""A ticket may come this long after the reducer's own wait for the group (next_chunk_timeout) ends."""


class LanePartsMixin:
    """The lane half of `StrictAllReduceRunner` (which provides the attributes used here)."""

    lanes: DirectLanes | None

    # ----- as a sender -------------------------------------------------------------------------------------------
    async def _open_lane(self, peer_id: PeerID) -> Lane | None:
        """A lane to reducer `peer_id` for this round, or None to send over libp2p."""
        peer = peer_id.to_base58()
        if self.lanes is None or not self.lanes.reachable(peer):
            return None
        # A reducer waits up to next_chunk_timeout for the group before it answers; silent past that, it is frozen or
        # gone, and trying libp2p as well held every member of a frozen island's group until it woke (7.4 s rounds).
        wait = min(TICKET_S, self.sender_timeout + TICKET_MARGIN_S) if self.sender_timeout else TICKET_S
        try:
            request = averaging_pb2.AveragingData(group_id=self.group_id)
            stub = self._get_peer_stub(peer_id)
            reply = await asyncio.wait_for(stub.rpc_direct_ticket(request), wait)
            offer = MSGPackSerializer.loads(reply.metadata) if reply.metadata else None
        except asyncio.TimeoutError:
            await self._ban_if_silent(peer_id, wait)
            raise AllreduceException(f"reducer {peer} did not answer in {wait:.1f}s") from None
        except Exception as error:  # an island without lanes, or one busy elsewhere: libp2p still works
            logger.info(f"no lane ticket from {peer}: {error!r}")
            offer = None
        if offer is None:
            self.lanes.mark_unreachable(peer)
            return None
        return await self.lanes.connect(peer, offer)

    async def _ban_if_silent(self, peer_id: PeerID, waited: float) -> None:
        """Ban `peer_id` as a sender to this reducer unless its parts have started to come: it answered nothing
        for `waited` s, so this member discards the round, and the poisoned parts tell every other member so now
        rather than after the chunk timeout (a frozen member held its group 15 s in tests/test_lane_liveness.py)."""
        connected = self._senders_connected.get(peer_id)
        if connected is not None and not connected.is_set() and not self._future.done():
            logger.warning(f"member {peer_id} answered nothing for {waited:.1f} s: the round is lost for everyone")
            await self._ban_sender(peer_id)

    async def _communicate_over_lane(self, lane: Lane, peer_id: PeerID, peer_index: int) -> int:
        """Send our parts for reducer `peer_id` over `lane` and register its replies; the parts registered."""
        expected = self.tensor_part_container.num_parts_by_peer[peer_index]
        self.byte_counters.count_lane()
        raw = self._compression_type == runtime_pb2.CompressionType.NONE
        parts = self.tensor_part_container.get_raw_input_parts(peer_index) if raw else None
        sending = asyncio.create_task(self._send_over_lane(lane, peer_index, parts))
        sending.add_done_callback(lambda _: self.own_parts.done(peer_index))
        try:
            if self.should_delay_results(self.peer_id):
                await sending
            received = await self._receive_over_lane(lane, peer_id, peer_index, expected, parts)
            await sending  # parts that never reached the reducer fail the round for every member
        finally:
            if not sending.done():
                sending.cancel()
        return received

    async def _send_over_lane(self, lane: Lane, peer_index: int, parts: tuple[torch.Tensor, ...] | None) -> None:
        with self._sharing_uplink(lane):
            await self._send_parts(lane, peer_index, parts)

    @contextlib.contextmanager
    def _sharing_uplink(self, lane: Lane) -> Iterator[None]:
        """While a run of frames goes out on `lane`, it takes its share of a declared uplink."""
        share = self.lanes.share if self.lanes is not None else None
        if share is not None:
            share.start(lane.sock)
        try:
            yield
        finally:
            if share is not None:
                share.stop(lane.sock)

    async def _send_parts(self, lane: Lane, peer_index: int, parts: tuple[torch.Tensor, ...] | None) -> None:
        if parts is not None:
            for part_index, part in enumerate(parts):
                await self._send_frame(lane, part_index, RAW_FP32, _raw_bytes(part), self.weight, self.reducer_timeout)
            return
        part_index = 0
        async for serialized in self.tensor_part_container.iterate_input_parts_for(peer_index):
            payload = serialized.SerializeToString()
            await self._send_frame(lane, part_index, PROTOBUF, payload, self.weight, self.reducer_timeout)
            part_index += 1

    async def _send_frame(self, lane: Lane, index: int, kind: int, payload, weight: float, timeout: float | None):
        sent = await asyncio.wait_for(lane.send(index, kind, payload, weight), timeout)
        self.byte_counters.add(sent=sent)
        if self.link is not None:
            await self.link.send(sent)

    async def _receive_over_lane(
        self,
        lane: Lane,
        peer_id: PeerID,
        peer_index: int,
        expected: int,
        parts: tuple[torch.Tensor, ...] | None,
    ) -> int:
        part_index = 0
        try:
            while part_index < expected:
                numel = None if parts is None else parts[part_index].numel()
                limit = 4 * numel if numel is not None else self._max_compressed_bytes()
                # Raw parts are received, compressed ones decoded, straight into the averaged tensor.
                destination = self._result_destination(peer_index, part_index)
                into = destination.view(torch.uint8) if destination is not None and parts is not None else None
                frame = lane.receive(part_index, limit, into=into)
                kind, _, payload = await asyncio.wait_for(frame, self.reducer_timeout)
                self.byte_counters.add(received=len(payload))
                averaged, _ = await self._decode_lane_part(kind, payload, numel, destination)
                self._register_part(peer_index, part_index, averaged)
                part_index += 1
        except LaneSilent as error:  # frozen or cut off: asking it again over libp2p would wait just as long
            raise AllreduceException(f"reducer {peer_id} fell silent after {part_index} parts: {error}") from None
        except (LaneError, OSError, asyncio.TimeoutError) as error:
            logger.info(f"direct lane from reducer {peer_id} broke after {part_index} parts: {error!r}")
        return part_index

    def _max_compressed_bytes(self) -> int:
        return self.tensor_part_container.part_size_bytes * 4 + PROTOBUF_SLACK

    async def _decode_lane_part(
        self, kind: int, payload: torch.Tensor, numel: int | None, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        """A part's values (and its compression) from a frame's payload, a compressed one decoded into `out` if
        given; a malformed one is a LaneError."""
        raw = self._compression_type == runtime_pb2.CompressionType.NONE
        if kind != (RAW_FP32 if raw else PROTOBUF):
            raise LaneError(f"a part of kind {kind} in a round whose codec is {self._compression_type}")
        if raw:
            if numel is None or payload.numel() != 4 * numel:
                raise LaneError(f"a part of {payload.numel()} bytes, expected {None if numel is None else 4 * numel}")
            return payload.view(torch.float32), runtime_pb2.CompressionType.NONE

        def decode() -> tuple[torch.Tensor, int]:
            message = runtime_pb2.Tensor.FromString(memoryview(payload.numpy()))  # parses without a copy to bytes
            if out is not None:
                return decode_into(message, out), message.compression
            return deserialize_torch_tensor(message).reshape(-1), message.compression

        try:
            values, compression = await asyncio.get_running_loop().run_in_executor(None, decode)
        except Exception as error:  # a peer's bytes: whatever they fail with costs that peer only
            raise LaneError(f"a part that does not decode: {error!r}") from None
        if numel is not None and values.numel() != numel:
            raise LaneError(f"a part of {values.numel()} values, expected {numel}")
        return values, compression

    # ----- as a reducer ------------------------------------------------------------------------------------------
    def note_sender_connected(self, peer_id: PeerID) -> None:
        """Record that sender `peer_id` opened a lane or a libp2p stream to this reducer."""
        connected = self._senders_connected.get(peer_id)
        if connected is not None:
            connected.set()

    def expect_sender(self, peer_id: PeerID, hosts: int) -> None:
        """Ban sender `peer_id`, just handed a ticket for a lane to one of `hosts` addresses, unless it opens that
        lane or falls back to a libp2p stream in time.

        The ticket counts the sender as started, so hivemind's missing-sender check no longer covers it: without
        this, a sender that dies or freezes between its ticket and its connect holds the round until the
        all-reduce timeout (measured in benchmarks/chaos.py: 60 s lost by every member of the group)."""
        within = CONNECT_S * max(hosts, 1) + max(HELLO_S, self.sender_timeout or 0.0)
        task = asyncio.create_task(self._ban_if_never_connected(peer_id, within))
        self._connect_watches.add(task)
        task.add_done_callback(self._connect_watches.discard)

    async def _ban_if_never_connected(self, peer_id: PeerID, within: float) -> None:
        connected = self._senders_connected.get(peer_id)
        if connected is None:
            return
        try:
            await asyncio.wait_for(connected.wait(), within)
        except asyncio.TimeoutError:
            if not self._future.done():
                logger.warning(f"sender {peer_id} took a lane ticket but never connected within {within:.0f} s: banned")
                await self._ban_sender(peer_id)

    async def reduce_from_lane(self, lane: Lane, sender_index: int) -> None:
        """Reduce one sender's parts arriving over `lane` and send it the averaged parts."""
        peer_id = self.sender_peer_ids[sender_index]
        self.note_sender_connected(peer_id)
        if self._future.done():
            return
        self.active_senders.add(peer_id)
        if len(self.active_senders) == len(self.sender_peer_ids):
            self.all_senders_started.set()
        delay = self.should_delay_results(peer_id)
        held: list[tuple[int, int, object]] = []
        shapes = [part.shape for part in self.parts_for_local_averaging]
        arrived: asyncio.Queue = asyncio.Queue(maxsize=READ_AHEAD)
        reading = asyncio.create_task(self._read_lane_parts(lane, shapes, arrived))
        # Paced, a member sends its own parts before its replies (p2p_diloco.net.pacing): they queue meanwhile.
        paced = self.lanes is not None and self.lanes.paced and not delay
        replies: asyncio.Queue | None = asyncio.Queue() if paced else None
        writer = asyncio.create_task(self._write_replies(lane, replies)) if replies is not None else None
        part_index = 0
        try:
            while part_index < self.tensor_part_reducer.num_parts:
                item = await arrived.get()
                if isinstance(item, BaseException):
                    raise item
                if writer is not None and writer.done():
                    writer.result()  # a reply that could not be sent ends the lane now
                kind, weight, values, compression = item
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, values.view(shapes[part_index]), weight=weight
                    )
                except BannedException:
                    break
                part_index += 1
                reply = await self._reply_payload(part_index - 1, kind, averaged, compression)
                if delay:
                    held.append((part_index - 1, kind, reply))
                elif replies is not None:
                    replies.put_nowait((part_index - 1, kind, reply))
                else:
                    await self._send_frame(lane, part_index - 1, kind, reply, 0.0, self.sender_timeout)
            for index, kind, reply in held:
                await self._send_frame(lane, index, kind, reply, 0.0, self.sender_timeout)
            if writer is not None:
                replies.put_nowait(None)
                await writer
            # The sender closes the lane once it holds every result, also those it asked again for over libp2p:
            # until then this round's replies are not all out (see StrictAllReduceRunner.wait_for_replies).
            if part_index == self.tensor_part_reducer.num_parts:  # a banned sender's parts are no longer read
                await asyncio.wait_for(reading, self.sender_timeout)
        except (LaneError, OSError, asyncio.TimeoutError, AllreduceException) as error:
            logger.info(f"direct lane to sender {peer_id} ended after {part_index} parts: {error!r}")
        finally:
            reading.cancel()
            if writer is not None:
                writer.cancel()
            self.byte_counters.add_wire(lane.bytes_sent, lane.bytes_received)
            self._sender_stream_closed()
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(peer_id)

    async def _reply_payload(self, index: int, kind: int, averaged: torch.Tensor, compression: int):
        """Averaged part `index` as its reply frame carries it (recorded for a member that may ask for it again)."""
        if kind == RAW_FP32:
            await self.served.record(index, averaged)
            return _raw_bytes(averaged)
        return (await self.served.serialized(index, averaged, compression)).SerializeToString()

    async def _write_replies(self, lane: Lane, replies: asyncio.Queue) -> None:
        """Send the replies queued for one sender, in order, once this member's own parts are out; None ends them."""
        try:  # bounded all the same: a reply held forever would hold the sender's whole round
            await asyncio.wait_for(self.own_parts.event.wait(), self.sender_timeout or TICKET_S)
        except asyncio.TimeoutError:
            logger.debug("own parts still going out after the chunk timeout: replies go now")
        with self._sharing_uplink(lane):
            while (reply := await replies.get()) is not None:
                index, kind, payload = reply
                await self._send_frame(lane, index, kind, payload, 0.0, self.sender_timeout)

    async def _read_lane_parts(self, lane: Lane, shapes: list[torch.Size], arrived: asyncio.Queue) -> None:
        """Read and decode a sender's parts ahead of the reduction, into READ_AHEAD + 2 rotating buffers (a part's
        buffer is free again once the reduction has taken the part that follows it: reducers keep no part past its
        reduction), then wait for the sender to close the lane."""
        largest = max((shape.numel() for shape in shapes), default=0)
        buffers = [torch.empty(4 * largest + PROTOBUF_SLACK, dtype=torch.uint8) for _ in range(READ_AHEAD + 2)]
        compressed = self._compression_type != runtime_pb2.CompressionType.NONE
        # Compressed parts decode into rotating fp32 buffers too: a fresh one per part cost more in page faults.
        decoded = [torch.empty(largest if compressed else 0) for _ in buffers]
        try:
            for part_index, shape in enumerate(shapes):
                numel = shape.numel()
                slot = part_index % len(buffers)
                frame = lane.receive(part_index, 4 * numel + PROTOBUF_SLACK, into=buffers[slot])
                kind, weight, payload = await asyncio.wait_for(frame, self.sender_timeout)
                self.byte_counters.add(received=len(payload))
                out = decoded[slot][:numel] if compressed else None
                values, compression = await self._decode_lane_part(kind, payload, numel, out)
                await arrived.put((kind, weight if math.isfinite(weight) else 0.0, values, compression))
        except (LaneError, OSError, asyncio.TimeoutError) as error:
            await arrived.put(error)
            return
        # Read on until the sender closes the lane: its heartbeats keep coming meanwhile, and its silence (frozen)
        # ends the lane, which fails a reply blocked on the sender's full receive window at once.
        await lane.wait_closed()


def _raw_bytes(values: torch.Tensor) -> memoryview:
    """A contiguous float32 tensor's bytes, without a copy."""
    return memoryview(values.detach().contiguous().view(-1).numpy()).cast("B")
