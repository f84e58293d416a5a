"""Gossip exchange of pseudo-gradients between islands, on hivemind's DecentralizedAverager.

Islands of one run meet through DHT keys under the run id, average with whichever islands are ready (no
central server, no fixed world size), and serve their outer state to late joiners.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import AveragingStage
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import CompressionBase, NoCompression, deserialize_torch_tensor
from hivemind.dht import DHT
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time, get_logger
from hivemind.utils.asyncio import aiter_with_timeout, as_aiter, azip
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming

from p2p_diloco.diloco.staleness import StalenessRule, group_weights
from p2p_diloco.net.allreduce import ByteCounters, StrictAllReduceRunner
from p2p_diloco.net.codecs import schema_hash_with_codec
from p2p_diloco.process import die_with_parent

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
            await runner.wait_for_replies(timeout=self.next_chunk_timeout or 5.0)
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
        future.result(timeout=30)

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
        return future.result(timeout=timeout + 5)

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


@dataclass
class ExchangeResult:
    """What one round of averaging gave this island."""

    merged: torch.Tensor | None
    """The group's weighted mean pseudo-gradient, or None when the round was discarded or found no partner."""
    partners: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Gathered metadata of the other islands in the group, by peer id."""
    wait_s: float = 0.0
    matchmaking_s: float = 0.0
    """Seconds from the start of the round until the group was assembled."""
    grace_window_s: float | None = None
    """The grace window this island allowed."""
    own_weight: float | None = None
    """This island's weight in the merge."""
    bytes_sent: float = 0.0
    bytes_recv: float = 0.0
    error: str | None = None
    transport: tuple[int, int] | None = None
    """Cumulative TCP (sent, received) bytes of the island's daemon, read right after this exchange."""


class GossipExchange:
    """Host-side handle: average a pseudo-gradient with whichever islands of the run are ready."""

    def __init__(
        self,
        dht: DHT,
        *,
        run_id: str,
        size: int,
        state_provider: StateProvider,
        target_group_size: int,
        quorum: int,
        min_matchmaking_time: float,
        request_timeout: float,
        allreduce_timeout: float,
        next_chunk_timeout: float,
        compression: CompressionBase | None = None,
        codec: str = "fp32",
        staleness_rule: StalenessRule | None = None,
    ):
        self.averager = PseudoGradientAverager(
            size,
            dht=dht,
            prefix=run_id,
            state_provider=state_provider,
            staleness_rule=staleness_rule,
            target_group_size=target_group_size,
            # hivemind assembles a group of one at once, skipping the grace window; the island merging
            # alone is the timeout path instead.
            min_group_size=max(2, quorum),
            min_matchmaking_time=min_matchmaking_time,
            request_timeout=request_timeout,
            allreduce_timeout=allreduce_timeout,
            next_chunk_timeout=next_chunk_timeout,
            compression=compression or NoCompression(),
            declare_state_period=10.0,
            shutdown_timeout=3.0,
            start=False,
        )
        # Matchmaking refuses islands whose schema differs, so naming the codec in it keeps codecs apart.
        self.averager.schema_hash = schema_hash_with_codec(self.averager.schema_hash, codec)
        self.averager.run_in_background(await_ready=True)
        self.min_matchmaking_time = min_matchmaking_time
        self.size = size
        self._schema_tag: int | None = None
        self.result_timeout = allreduce_timeout + 30.0

    @property
    def peer_id(self) -> str:
        """This island's peer id."""
        return self.averager.peer_id.to_base58()

    def average(
        self,
        pseudo_gradient: torch.Tensor,
        metadata: dict[str, Any],
        *,
        weight: float,
        grace_s: float,
        timeout: float,
        schema_tag: int | None = None,
    ) -> ExchangeResult:
        """One bounded round: the group's weighted average, or merged=None if no partner came or the round failed.

        The island leads a group for `grace_s` seconds (islands that arrive meanwhile join it), or joins a group
        another island leads; `timeout` bounds the whole search when a quorum above one is required.
        """
        sent0, recv0 = self.averager.byte_counters.read()
        start = time.monotonic()
        if schema_tag != self._schema_tag:
            self.averager.set_schema_tag(schema_tag)
            self._schema_tag = schema_tag
        values = pseudo_gradient.reshape(-1)
        if values.numel() > self.size:
            raise ValueError(f"pseudo-gradient of {values.numel()} values exceeds the exchange buffer of {self.size}")
        with self.averager.get_tensors() as tensors:
            # A smaller fragment travels in the front of the buffer; the zero tail averages to zero.
            tensors[0][: values.numel()].copy_(values)
            tensors[0][values.numel() :].zero_()
        result = ExchangeResult(merged=None)
        gathered = None
        try:
            grace_s = max(grace_s, self.min_matchmaking_time)
            control = self.averager.step(
                gather=metadata,
                weight=weight,
                scheduled_time=get_dht_time() + grace_s,
                timeout=max(timeout, grace_s + 1.0),
                allow_retries=True,
                wait=False,
            )
            while not control.done() and control.stage != AveragingStage.RUNNING_ALLREDUCE:
                time.sleep(0.005)  # the stage lives in shared memory; hivemind offers no event for it
            result.matchmaking_s = time.monotonic() - start
            gathered = control.result(timeout=self.result_timeout)
        except Exception as error:  # hivemind raises assorted errors for a failed round: all mean "discard"
            result.error = f"{type(error).__name__}: {error}"
        if gathered and len(gathered) > 1:
            with self.averager.get_tensors() as tensors:
                result.merged = tensors[0][: values.numel()].clone()
            result.partners = {
                peer.to_base58(): data for peer, data in gathered.items() if peer != self.averager.peer_id
            }
        elif result.error is None:
            result.error = "no partner within the window"
        sent1, recv1 = self.averager.byte_counters.read()
        result.wait_s = time.monotonic() - start
        result.bytes_sent, result.bytes_recv = sent1 - sent0, recv1 - recv0
        return result

    def load_state(
        self, timeout: float, peers: Sequence[str] | None = None
    ) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """Download the outer state from the given peers, or from the best state donor of the run."""
        peer_ids = None if peers is None else [PeerID.from_base58(peer) for peer in peers]
        return self.averager.load_state_from(peer_ids, timeout)

    def set_state_priority(self, priority: float) -> None:
        """Higher priority makes this island the preferred donor for late joiners."""
        self.averager.state_sharing_priority = priority

    def shutdown(self) -> None:
        """Stop the averager process."""
        if self.averager.is_alive():
            self.averager.shutdown()
