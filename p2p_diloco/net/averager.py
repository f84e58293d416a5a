"""hivemind's DecentralizedAverager over one flat pseudo-gradient buffer: all-or-nothing rounds, weights by the
group's staleness rule, matchmaking by schema, and the island's outer state served to and downloaded from peers."""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import deserialize_torch_tensor
from hivemind.dht import DHT
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_logger
from hivemind.utils.asyncio import aiter_with_timeout, as_aiter, azip
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming

from p2p_diloco.diloco.staleness import StalenessRule, group_weights
from p2p_diloco.net.allreduce import ByteCounters, StrictAllReduceRunner
from p2p_diloco.process import die_with_parent
from p2p_diloco.timeouts import AVERAGER_COMMAND_S, STATE_MARGIN_S

logger = get_logger(__name__)

StateProvider = Callable[[], tuple[dict[str, Any], Sequence[torch.Tensor]]]


class PseudoGradientAverager(DecentralizedAverager):
    """DecentralizedAverager over one flat pseudo-gradient buffer, all-or-nothing, serving the outer state."""

    def __init__(
        self,
        size: int,
        *,
        dht: DHT,
        prefix: str,
        state_provider: StateProvider,
        staleness_rule: StalenessRule | None = None,
        **kwargs: Any,
    ):
        self.byte_counters = ByteCounters()
        self._state_provider = state_provider
        self._staleness_rule = staleness_rule
        super().__init__([torch.zeros(size, dtype=torch.float32)], dht=dht, prefix=prefix, **kwargs)

    def run(self) -> None:
        """Serve averaging after arranging to die with the island's process."""
        die_with_parent()
        super().run()

    def get_current_state(self) -> tuple[dict[str, Any], Sequence[torch.Tensor], None]:
        """The island's outer state (anchor, momentum, step...) for a peer that joins late or resyncs."""
        metadata, tensors = self._state_provider()
        return metadata, tensors, None

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes | None = None, **kwargs
    ) -> None:
        group_id = group_info.group_id if group_id is None else group_id
        weight = self._weight_in_group(group_info)
        if weight is not None:
            kwargs["weight"] = weight
        backup = [tensor.clone() for tensor in tensors]
        runner = StrictAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            byte_counters=self.byte_counters,
            **kwargs,
        )
        assert group_id in self._running_groups, f"group {group_id} was not registered"
        self._running_groups[group_id].set_result(runner)
        try:
            async for tensor, averaged in azip(as_aiter(*tensors), runner):
                tensor.copy_(averaged)
            if runner.failed_size:
                raise AllreduceException(f"partial all-reduce: {runner.failed_size} values were not averaged")
            # A sum is ~25x cheaper than an elementwise check and is NaN/inf whenever any value is.
            if not all(bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all()) for tensor in tensors):
                raise AllreduceException("partial all-reduce: a group member failed mid-round")
            await runner.wait_for_replies(timeout=self.next_chunk_timeout)
        except BaseException:
            # Never leave a half-averaged buffer behind, not even for a retry within the same step.
            for tensor, saved in zip(tensors, backup):
                tensor.copy_(saved)
            raise

    def _weight_in_group(self, group_info: GroupInfo) -> float | None:
        """This island's staleness-ruled weight against the group's clock (None: keep the weight it was given)."""
        if self._staleness_rule is None:
            return None
        members = {}
        for peer, gathered in zip(group_info.peer_ids, group_info.gathered):
            metadata = self.serializer.loads(self.serializer.loads(gathered)[2])
            if not isinstance(metadata, dict) or "base_weight" not in metadata or "outer_step" not in metadata:
                return None
            members[peer] = metadata
        weight = group_weights(members, self._staleness_rule)[self.peer_id]
        if weight == 0.0:
            logger.info("this island's contribution is too stale for the group: it sends weight 0")
        return weight

    def set_schema_tag(self, tag: int | None) -> None:
        """Match only with islands exchanging the same thing (e.g. the same fragment) from now on."""
        future = MPFuture()
        self._outer_pipe.send(("_set_schema_tag", [], dict(tag=tag, future=future)))
        future.result(timeout=AVERAGER_COMMAND_S)

    async def _set_schema_tag(self, tag: int | None, future: MPFuture) -> None:
        suffix = b"" if tag is None else f"fragment-{tag}".encode()
        self._matchmaking.schema_hash = (
            hashlib.sha256(self.schema_hash + suffix).digest() if suffix else self.schema_hash
        )
        future.set_result(True)

    def load_state_from(
        self, peers: Sequence[PeerID] | None, timeout: float
    ) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """Download the outer state from the first of `peers` that answers (any state donor if None)."""
        future = MPFuture()
        self._outer_pipe.send(("_load_state_from", [], dict(peers=peers, timeout=timeout, future=future)))
        return future.result(timeout=timeout + STATE_MARGIN_S)

    async def _load_state_from(self, future: MPFuture, peers: Sequence[PeerID] | None, timeout: float) -> None:
        try:
            if peers is None:
                key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
                donors, _ = await self.dht.get(key, latest=True, return_future=True) or ({}, None)
                priority = {
                    PeerID(peer_id): (float(info.value), random.random())
                    for peer_id, info in (donors or {}).items()
                    if isinstance(getattr(info, "value", None), (float, int))
                }
                peers = sorted(priority, key=priority.get, reverse=True)
            deadline = time.monotonic() + timeout
            for peer in peers:
                if peer == self.peer_id or time.monotonic() >= deadline:
                    continue
                try:
                    result = await asyncio.wait_for(self._download_state(peer), deadline - time.monotonic())
                except Exception as error:  # a donor that fails costs only itself
                    logger.warning(f"could not download state from {peer}: {error!r}")
                    continue
                if result is not None:
                    future.set_result(result)
                    return
        finally:
            if not future.done():
                future.set_result(None)

    async def _download_state(self, peer: PeerID) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        metadata, parts, tensors = None, [], []
        async for message in aiter_with_timeout(stream, timeout=self.next_chunk_timeout):
            if message.metadata:
                metadata = self.serializer.loads(message.metadata)
            if message.tensor_part.dtype and parts:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
            parts.append(message.tensor_part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        return None if not metadata else (metadata, tensors)
