"""An all-or-nothing, bit-identical all-reduce on top of hivemind's butterfly all-reduce.

hivemind's runner can report success when a group member died mid-round: some parts are then averaged over
everyone, some over the survivors, some left local. Here a reducer that loses a sender before it has received
all of that sender's parts poisons every part it returns from then on with NaN, and a receiver that misses a
reducer's results counts the failed elements; either way every survivor sees the round fail and discards it.
Reducers also return the averaged values rather than differences, so every member ends with the same bits.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable, Sequence

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartContainer
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import P2PContext, P2PDaemonError, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_logger
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, as_aiter, attach_event_on_finished, azip

from p2p_diloco.net.codecs import decode_into
from p2p_diloco.net.counters import ByteCounters, LinkLimiter
from p2p_diloco.net.direct import DirectLanes
from p2p_diloco.net.lane_parts import LanePartsMixin
from p2p_diloco.net.pacing import OwnPartsOut
from p2p_diloco.net.reducers import make_reducer
from p2p_diloco.net.repair import ServedParts

logger = get_logger(__name__)


async def write_results_in_place(container: TensorPartContainer) -> AsyncIterator[torch.Tensor]:
    """hivemind's TensorPartContainer.iterate_output_tensors, but each averaged part is copied into the local tensor
    as it arrives and the local tensors themselves are yielded.

    This replaces a method of hivemind's container and reads its private queues: the stock method concatenates every
    tensor's parts into a new tensor (200 MB of fresh pages per round at 50M values) that is then copied again. Writing
    part p early is safe: its result arrives only after its reducer (ourselves included) has consumed our part p, and
    a failed round restores the tensors from the averager's backup."""
    assert not container._outputs_consumed, "output tensors are already iterated and no longer available."
    container._outputs_consumed = True
    peer_index = num_parts_processed = 0
    for tensor_index, tensor in enumerate(container.local_tensors):
        flat, offset, parts_done = tensor.view(-1), 0, 0
        while parts_done < container.num_parts_by_tensor[tensor_index]:
            if num_parts_processed >= container.num_parts_by_peer[peer_index]:
                num_parts_processed = 0
                peer_index += 1
                continue
            if not container._output_parts_by_peer[peer_index]:
                container._output_part_available[peer_index].clear()
                await container._output_part_available[peer_index].wait()
                if container.finished.is_set():
                    raise AllreduceException("All-reduce was terminated during iteration")
            part = container._output_parts_by_peer[peer_index].popleft()
            if part.numel() > flat.numel() - offset:
                raise AllreduceException(f"an averaged part of {part.numel()} values overflows tensor {tensor_index}")
            destination = flat[offset : offset + part.numel()]
            if part.data_ptr() != destination.data_ptr():  # most parts were received or decoded in place
                destination.copy_(part.reshape(-1))
            offset += part.numel()
            num_parts_processed += 1
            parts_done += 1
        if offset != flat.numel():
            raise AllreduceException(f"averaged parts cover {offset} of tensor {tensor_index}'s {flat.numel()} values")
        yield tensor


CLEANUP_WAIT_S = 0.5
"""How long a member that gave up on a round waits for the runner's clean-up before it moves on."""


def _finite(tensor: torch.Tensor) -> bool:
    # A sum is ~25x cheaper than an elementwise check and is NaN/inf whenever any value is (or on overflow).
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def _retrieve(task: asyncio.Task) -> None:
    """Fetch a background task's outcome, so that asyncio does not report it as never retrieved."""
    if not task.cancelled():
        task.exception()


class StrictAllReduceRunner(LanePartsMixin, AllReduceRunner):
    """AllReduceRunner that returns averages (not deltas), poisons partial reductions, counts bytes and moves parts
    over direct lanes where the reducer can be reached."""

    def __init__(
        self,
        *,
        byte_counters: ByteCounters,
        robust_merge: str = "none",
        weight_caps: dict[PeerID, float] | None = None,
        on_dropped: Callable[[PeerID, str], None] | None = None,
        lanes: DirectLanes | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.byte_counters = byte_counters
        self.lanes = lanes
        self.link = LinkLimiter.from_env()
        reduces = self.tensor_part_container.num_parts_by_peer[self.ordered_peer_ids.index(self.peer_id)] > 0
        self._remote_senders = sum(peer != self.peer_id for peer in self.sender_peer_ids) if reduces else 0
        me, sends = self.ordered_peer_ids.index(self.peer_id), self.peer_id in self.sender_peer_ids
        parts_by_peer = self.tensor_part_container.num_parts_by_peer
        self.own_parts = OwnPartsOut([i for i, n in enumerate(parts_by_peer) if n and i != me] if sends else [])
        self._closed_sender_streams = 0
        self._replies_sent = asyncio.Event()
        if self._remote_senders == 0:
            self._replies_sent.set()
        self.tensor_part_reducer.num_parts = 0  # retire the stock reducer quietly (it would warn on deletion)
        self.tensor_part_reducer.finalize()
        caps = [math.inf if weight_caps is None else weight_caps.get(peer, 0.0) for peer in self.sender_peer_ids]
        dropped = None
        if on_dropped is not None:
            dropped = lambda index, why: on_dropped(self.sender_peer_ids[index], why)  # noqa: E731
        sparse = getattr(self.tensor_part_container.compression, "name", None) == "topk"
        self.tensor_part_reducer = make_reducer(
            robust_merge, tuple(part.shape for part in self.parts_for_local_averaging), caps, dropped, sparse
        )
        self._compression_type = self.tensor_part_container.compression.compression_type
        container = self.tensor_part_container
        container.iterate_output_tensors = lambda: write_results_in_place(container)
        self.served = ServedParts(self.group_id, self.sender_peer_ids, self.tensor_part_reducer.num_parts)
        self._senders_connected = {peer: asyncio.Event() for peer in self.sender_peer_ids if peer != self.peer_id}
        self._connect_watches: set[asyncio.Task] = set()
        self.doomed = asyncio.Event()
        """Set once a reducer failed or sent a poisoned part: this member will discard the round whatever else
        arrives."""
        self.poisoned = False
        """True once a registered averaged part held NaN or inf (every part is checked as it is registered)."""

    async def average_into(self, tensors: Sequence[torch.Tensor], grace: float) -> None:
        """Run the all-reduce, writing the averages into `tensors`. Once a reducer has failed or sent a poisoned
        part the round is lost to this member: it goes on for at most `grace` s (its own reducer may still serve
        the others), then gives up.

        Waiting for the rest cost every survivor of a kill and a freeze 14 s in a 5-member group (a frozen reducer
        takes a ticket timeout, a stream timeout and a repair timeout to fail), and a woken member the whole
        all-reduce timeout (measured in benchmarks/chaos.py: 60 s)."""
        consume = asyncio.create_task(self._consume(tensors))
        doomed = asyncio.create_task(self.doomed.wait())
        try:
            await asyncio.wait({consume, doomed}, return_when=asyncio.FIRST_COMPLETED)
            if not consume.done():
                try:
                    await asyncio.wait_for(asyncio.shield(consume), grace)
                except asyncio.TimeoutError:
                    gave_up = f"the round is lost; gave up on the rest of the round after {grace:g} s"
                    raise AllreduceException(gave_up) from None
            await consume
        finally:
            doomed.cancel()
            if not consume.done():
                # The results stop being written at the first step of the cancellation; the runner's own clean-up
                # then waits for its calls to the other members, a dial to a dead one taking seconds: leave that
                # to the background rather than hold this member's next attempt.
                consume.cancel()
                consume.add_done_callback(_retrieve)
                await asyncio.wait({consume}, timeout=CLEANUP_WAIT_S)

    async def _consume(self, tensors: Sequence[torch.Tensor]) -> None:
        async for tensor, averaged in azip(as_aiter(*tensors), self):
            if averaged.data_ptr() != tensor.data_ptr():  # the runner writes results in place
                tensor.copy_(averaged)

    async def wait_for_replies(self, timeout: float) -> None:
        """Wait (at most `timeout` s) until every sender's stream to this reducer has closed, so that the bytes
        this member sends as a reducer count in this round rather than trickling into the next one."""
        try:
            await asyncio.wait_for(self._replies_sent.wait(), timeout)
        except asyncio.TimeoutError:
            logger.debug("a sender's stream to this reducer is still open; its bytes may count in a later round")

    @property
    def failed_size(self) -> int:
        """Elements whose reducer never answered."""
        return self.tensor_part_container.failed_size

    async def _local_round_trip(self, peer_index: int, part_index: int, averaged_part: torch.Tensor) -> torch.Tensor:
        # Remote members decode the compressed average; the reducer must use the same bits for its own part.
        destination = self._result_destination(peer_index, part_index)
        if self._compression_type == runtime_pb2.CompressionType.NONE:
            return averaged_part.clone() if destination is None else destination.copy_(averaged_part.view(-1))
        serialized = await self.served.serialized(part_index, averaged_part, self._compression_type)
        return deserialize_torch_tensor(serialized) if destination is None else decode_into(serialized, destination)

    def _result_destination(self, peer_index: int, part_index: int) -> torch.Tensor | None:
        """Where reducer `peer_index`'s averaged part `part_index` ends up: our own input part there, a flat view
        of the averaged tensor (written early as in `write_results_in_place`, and restored from the averager's
        backup if the round fails), so that it is received or decoded straight into place. None if not fp32."""
        parts = self.tensor_part_container._input_parts_by_peer[peer_index]
        if part_index >= len(parts):
            return None
        part = parts[part_index][0]
        return part if part.dtype == torch.float32 and part.is_contiguous() and not part.requires_grad else None

    async def _communicate_with_peer(self, peer_id: PeerID) -> None:
        """Send our parts to one reducer and register the averaged parts it returns."""
        peer_index = self.ordered_peer_ids.index(peer_id)
        if peer_id == self.peer_id:
            sender_index = self.sender_peer_ids.index(peer_id)
            for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
                averaged_part = await self.tensor_part_reducer.accumulate_part(
                    sender_index, part_index, tensor_part, weight=self.weight
                )
                averaged_part = await self._local_round_trip(peer_index, part_index, averaged_part)
                self._register_part(peer_index, part_index, averaged_part)
            return
        try:
            expected = self.tensor_part_container.num_parts_by_peer[peer_index]
            deserialize = self._reply_decoder(peer_id)
            lane = await self._open_lane(peer_id)
            if lane is not None:
                try:
                    received = await self._communicate_over_lane(lane, peer_id, peer_index)
                    if received < expected:  # before closing the lane: its end tells the reducer we are done
                        received = await self._ask_again(peer_id, peer_index, deserialize, received, expected)
                finally:
                    self.byte_counters.add_wire(lane.bytes_sent, lane.bytes_received)
                    lane.close()
            else:
                done_sending = asyncio.Event()
                inputs_aiter = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
                stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs_aiter)
                if self.should_delay_results(self.peer_id):
                    await done_sending.wait()
                received = await self._register_replies(peer_id, peer_index, stream, deserialize, 0, expected)
            if received < expected:
                received = await self._ask_again(peer_id, peer_index, deserialize, received, expected)
            if received != expected:
                raise AllreduceException(f"peer {peer_id} sent {received} parts, expected {expected}")
        except BaseException as error:
            if not self.doomed.is_set() or not isinstance(error, asyncio.CancelledError):
                logger.warning(f"reducer {peer_id} failed, the round will be discarded: {error!r}")
            self.tensor_part_container.register_failed_reducer(peer_index)
            self._doom()
            raise
        finally:
            self.own_parts.done(peer_index)

    def _register_part(self, peer_index: int, part_index: int, averaged: torch.Tensor) -> None:
        """Register a reducer's averaged part. A poisoned one (its reducer lost a sender) dooms the round at once:
        it will be discarded whatever else arrives, and waiting on for a frozen reducer held every survivor of a
        freeze about 5 s longer (benchmarks/chaos.py: 11.4 s rounds)."""
        if not self.poisoned and not _finite(averaged):
            logger.info(f"reducer {self.ordered_peer_ids[peer_index]} sent a poisoned part: the round is lost")
            self.poisoned = True
            self._doom()
        self.tensor_part_container.register_processed_part(peer_index, part_index, averaged)

    def _doom(self) -> None:
        """This member will discard the round: its reducer poisons what it returns from now on and gives up on the
        senders that never started, so every member discards the round alike and without waiting. A member woken
        from a freeze otherwise waited the chunk timeout for partners long gone (tests/test_lane_liveness.py)."""
        if self.doomed.is_set():
            return
        self.doomed.set()
        self.tensor_part_reducer.poisoned = True
        self.own_parts.release()
        # A sender that took a lane ticket counts as active (`expect_sender`) but may never connect.
        missing = [peer for peer, connected in self._senders_connected.items() if not connected.is_set()]
        if missing and not self._future.done():
            task = asyncio.create_task(self._ban_all(missing))
            self._connect_watches.add(task)
            task.add_done_callback(self._connect_watches.discard)

    async def _ban_all(self, peers: list[PeerID]) -> None:
        for peer in peers:
            if not self._senders_connected[peer].is_set():
                logger.info(f"sender {peer} never connected and the round is lost: banned")
                await self._ban_sender(peer)

    def _reply_decoder(self, peer_id: PeerID) -> Callable[[averaging_pb2.AveragingData], torch.Tensor]:
        """Decodes (and counts) a reducer's reply message; a message that is not an averaged part fails the reducer."""

        def deserialize(message: averaging_pb2.AveragingData) -> torch.Tensor:
            if message.code != averaging_pb2.AVERAGED_PART:
                raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(message.code)}")
            self.byte_counters.add(received=message.tensor_part.ByteSize())
            return deserialize_torch_tensor(message.tensor_part)

        return deserialize

    async def _ask_again(self, peer_id: PeerID, peer_index: int, deserialize, received: int, expected: int) -> int:
        """Fetch the averaged parts a broken reply stream lost from the same reducer over a new stream."""
        logger.info(f"reducer {peer_id}'s reply stream ended after {received} of {expected} parts; asking again")
        # AveragingData has no free field: `weight` carries the index of the first missing part.
        request = averaging_pb2.AveragingData(
            group_id=self.group_id, weight=received, tensor_part=runtime_pb2.Tensor(compression=self._compression_type)
        )
        stream = await self._get_peer_stub(peer_id).rpc_repair_parts(request)

        def mended() -> None:
            self.byte_counters.count_repair()
            logger.info(f"reducer {peer_id} sent the missing parts again: the round is complete")

        return await self._register_replies(peer_id, peer_index, stream, deserialize, received, expected, mended)

    async def _register_replies(
        self,
        peer_id: PeerID,
        peer_index: int,
        stream,
        deserialize,
        first: int,
        expected: int,
        on_last_part: Callable[[], None] | None = None,
    ) -> int:
        """Register a reducer's averaged parts from `first` on; the index after the last one that arrived."""
        part_index = first
        try:
            async for averaged_part in amap_in_executor(
                deserialize,
                aiter_with_timeout(stream, self.reducer_timeout),
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                if part_index == expected - 1 and on_last_part is not None:
                    # Before registering: the last part may complete the round, and the member may be gone before
                    # this stream reports its end.
                    on_last_part()
                self._register_part(peer_index, part_index, averaged_part)
                part_index += 1
        except (ConnectionError, asyncio.IncompleteReadError, P2PDaemonError) as error:  # a broken stream
            logger.info(f"reply stream from {peer_id} broke after {part_index} parts: {error!r}")
        return part_index

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Our parts for one reducer, counted as sent."""
        async for message in super()._generate_input_for_peer(peer_index):
            self.byte_counters.add(sent=message.tensor_part.ByteSize())
            if self.link is not None:
                await self.link.send(message.tensor_part.ByteSize())
            yield message
        self.own_parts.done(peer_index)

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's handler for a sender's libp2p stream, noting that the sender connected (`expect_sender`)."""
        self.note_sender_connected(context.remote_id)
        async for message in super().rpc_aggregate_part(stream, context):
            yield message

    async def _accumulate_parts_streaming(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """As a reducer: add a sender's parts into the average and send back the averaged parts."""
        part_index = 0
        try:
            async for tensor_part, weight, part_compression in amap_in_executor(
                lambda msg: (
                    deserialize_torch_tensor(msg.tensor_part),
                    msg.weight,
                    msg.tensor_part.compression,
                ),
                self._count_received(stream),
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                try:
                    averaged_part = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight
                    )
                    part_index += 1
                except BannedException:
                    break
                serialized = await self.served.serialized(part_index - 1, averaged_part, part_compression)
                self.byte_counters.add(sent=serialized.ByteSize())
                if self.link is not None:
                    await self.link.send(serialized.ByteSize())
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
        finally:
            self._sender_stream_closed()
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

    def _sender_stream_closed(self) -> None:
        self._closed_sender_streams += 1
        if self._closed_sender_streams >= self._remote_senders:
            self._replies_sent.set()

    async def _count_received(
        self, stream: AsyncIterator[averaging_pb2.AveragingData]
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in stream:
            self.byte_counters.add(received=message.tensor_part.ByteSize())
            yield message
