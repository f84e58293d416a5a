"""The averager's side of the outer state: serving it to allowed peers, and downloading the swarm's (verified).

A mixin of `PseudoGradientAverager`: the rpc handlers run in the averager's process, `load_state_from` is called
from the island's.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence

# hivemind tells streaming handlers from unary ones by typing.AsyncIterator's name (not collections.abc's).
from typing import Any, AsyncIterator  # noqa: UP035

import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming

from p2p_diloco.net.state_transfer import AnchorSink, State, verified_download
from p2p_diloco.timeouts import STATE_MARGIN_S

logger = logging.getLogger(__name__)


class StateServingMixin:
    """Serves the island's outer state to allowed peers and downloads the swarm's (see `state_transfer`)."""

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """Serve the state only to allowed peers (an empty answer sends the asker to the next donor)."""
        if not self.gate.allowed(context.remote_id.to_base58()):
            return
        async for response in super().rpc_download_state(request, context):
            yield response

    async def rpc_state_info(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> averaging_pb2.DownloadData:
        """What this island's state is (outer step, digest, model), without the tensors."""
        if not self.gate.allowed(context.remote_id.to_base58()) or not self.allow_state_sharing:
            return averaging_pb2.DownloadData()
        metadata, _, _ = await self._get_current_state_from_host_process(with_tensors=False)  # serialized already
        return averaging_pb2.DownloadData(metadata=metadata)

    async def rpc_present_membership(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> averaging_pb2.DownloadData:
        """Check a peer's membership token (shown before it asks for state); answer with this island's own."""
        try:
            token = self.serializer.loads(request.metadata)
        except Exception:  # garbage: no token
            token = None
        reason = self.gate.admit(context.remote_id.to_base58(), token)
        return averaging_pb2.DownloadData(
            metadata=self.serializer.dumps({"ok": reason is None, "reason": reason, "membership": self._token})
        )

    def load_state_from(
        self,
        peers: Sequence[PeerID] | None,
        timeout: float,
        *,
        shapes: Sequence[tuple[int, ...]] | None = None,
        fingerprint: str | None = None,
        max_step: int | None = None,
        on_anchor: AnchorSink | None = None,
    ) -> State | None:
        """The outer state most of `peers` (any state donors if None) agree on, verified; None if none delivers.

        With `on_anchor`, it is called (in this thread) with the agreed state's anchor as soon as that is in, before
        the rest of the state (the outer momentum) is: the caller can train on it meanwhile, and must not keep what
        it trained should this return another anchor or None (the whole state is verified only at the end)."""
        future, anchor = MPFuture(), (MPFuture() if on_anchor is not None else None)
        kwargs = dict(peers=peers, timeout=timeout, shapes=shapes, fingerprint=fingerprint, max_step=max_step)
        self._outer_pipe.send(("_load_state_from", [], dict(**kwargs, future=future, anchor=anchor)))
        if anchor is not None and (early := anchor.result(timeout=timeout + STATE_MARGIN_S)) is not None:
            on_anchor(*early)
        return future.result(timeout=timeout + STATE_MARGIN_S)

    async def _load_state_from(
        self, future: MPFuture, peers, timeout, shapes, fingerprint, max_step, anchor: MPFuture | None = None
    ) -> None:
        def first_anchor(metadata: dict[str, Any], tensor: torch.Tensor) -> None:
            if not anchor.done():  # only the first: the caller trains on it, a later one waits for the end
                anchor.set_result((metadata, tensor))

        try:
            deadline = time.monotonic() + timeout
            donors = [peer for peer in (peers or await self._donors()) if peer != self.peer_id]
            donors = [peer for peer in donors if not self.gate.banned(peer.to_base58())]
            if self.gate.private:
                donors = [peer for peer in await asyncio.gather(*map(self._present, donors)) if peer is not None]
            remaining = max(0.1, deadline - time.monotonic())
            state = await verified_download(
                donors,
                ask=self._state_info,
                download=self._download_state,
                fingerprint=fingerprint,
                shapes=shapes,
                max_step=max_step,
                on_liar=lambda peer, why: self.gate.ban(peer.to_base58(), f"{why} as a state donor"),
                timeout=remaining,
                on_anchor=None if anchor is None else first_anchor,
            )
            if anchor is not None and not anchor.done():
                anchor.set_result(None)  # before the state: the island waits for the anchor first
            future.set_result(state)
        finally:
            if anchor is not None and not anchor.done():
                anchor.set_result(None)
            if not future.done():
                future.set_result(None)

    async def _donors(self) -> list[PeerID]:
        """Every peer that declared itself a state donor of the run (their declared priority is not trusted)."""
        key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
        found, _ = await self.dht.get(key, latest=True, return_future=True) or ({}, None)
        donors = []
        for peer_id in (found or {}).keys():
            try:
                donors.append(PeerID(peer_id))
            except Exception:  # a malformed subkey is someone else's garbage
                continue
        random.shuffle(donors)
        return donors

    async def _present(self, peer: PeerID) -> PeerID | None:
        """Show our membership token to a donor; the donor if it shows a valid one back."""
        try:
            stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
            request = averaging_pb2.DownloadData(metadata=self.serializer.dumps(self._token))
            answer = self.serializer.loads((await stub.rpc_present_membership(request)).metadata)
        except Exception as error:  # a donor that cannot answer is no donor
            logger.debug(f"donor {peer} did not answer about membership: {error!r}")
            return None
        if not isinstance(answer, dict) or self.gate.admit(peer.to_base58(), answer.get("membership")) is not None:
            return None
        return peer

    async def _state_info(self, peer: PeerID) -> Any:
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        answer = await stub.rpc_state_info(averaging_pb2.DownloadRequest())
        return self.serializer.loads(answer.metadata) if answer.metadata else None

    async def _download_state(self, peer: PeerID, on_first: AnchorSink | None = None) -> State | None:
        """A donor's state as it sent it (unverified); `on_first` gets its first tensor as soon as that is in."""
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        metadata, parts, tensors = None, [], []
        async for message in aiter_with_timeout(stream, timeout=self.next_chunk_timeout):
            if message.metadata:
                metadata = self.serializer.loads(message.metadata)
            if message.tensor_part.dtype and parts:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
                if len(tensors) == 1 and on_first is not None and metadata:
                    on_first(metadata, tensors[0])
            parts.append(message.tensor_part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        return None if not metadata else (metadata, tensors)
