"""Keeping an island connected: dial islands that are reachable only through a relay, re-ping the initial peers.

Both run inside the DHT process (its p2pd is the one every stream of the island goes through). A restarted
bootstrap comes back with an empty routing table; islands that ping it again put themselves back in it, so
newcomers joining through it find the swarm (hivemind pings initial peers only once, at start).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import Any

from hivemind.dht import DHT, DHTNode
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

logger = logging.getLogger(__name__)


def split_maddr(text: str) -> tuple[str, str | None]:
    """('/ip4/1.2.3.4/tcp/5', peer id) of '/ip4/1.2.3.4/tcp/5/p2p/<id>' (peer id None if there is none)."""
    if "/p2p/" not in text:
        return text, None
    address, peer = text.rsplit("/p2p/", 1)
    return address, peer


async def _dial(node: DHTNode, peer: str, addresses: list[str], timeout: float) -> bool:
    peer_id = PeerID.from_base58(peer)
    # hivemind has no public way to dial a peer at a given address; its daemon client does (p2pd CONNECT).
    # The /p2p/ part is left out: hivemind's multiaddr encodes it in a form p2pd rejects.
    bare = [Multiaddr(split_maddr(address)[0]) for address in addresses]
    try:
        await asyncio.wait_for(node.p2p._client.connect(peer_id, bare), timeout)
        return True
    except Exception as error:  # an island we cannot reach costs only itself
        logger.debug(f"could not dial {peer} at {addresses}: {error!r}")
        return False


async def _connected_peers(dht: DHT, node: DHTNode) -> set[str]:
    return {info.peer_id.to_base58() for info in await node.p2p.list_peers()}


async def _connect_peers(dht: DHT, node: DHTNode, peers: dict[str, list[str]], timeout: float) -> dict[str, bool]:
    connected = await _connected_peers(dht, node)
    wanted = {peer: addresses for peer, addresses in peers.items() if peer not in connected and addresses}
    results = await asyncio.gather(*(_dial(node, peer, addresses, timeout) for peer, addresses in wanted.items()))
    return dict(zip(wanted, results))


async def _ping_peers(dht: DHT, node: DHTNode, maddrs: list[str], timeout: float) -> int:
    async def ping(text: str) -> bool:
        address, peer = split_maddr(text)
        if peer is None or not await _dial(node, peer, [address], timeout):
            return False
        return await _answers(node, peer, timeout)

    return sum(await asyncio.gather(*(ping(text) for text in maddrs)))


async def _answers(node: DHTNode, peer: str, timeout: float) -> bool:
    """Whether `peer`'s DHT node answers a ping within `timeout` (any failure: it does not)."""
    with contextlib.suppress(Exception):
        return await asyncio.wait_for(node.protocol.call_ping(PeerID.from_base58(peer)), timeout) is not None
    return False


def probe_peers(dht: DHT, peers: list[str], timeout: float) -> Any:
    """Start a DHT ping of each peer id over the connections this island holds; a future (hivemind's MPFuture) of
    the set that answered within `timeout`. A frozen island keeps its connections open but answers nothing."""
    return dht.run_coroutine(functools.partial(_answering, peers=peers, timeout=timeout), return_future=True)


async def _answering(dht: DHT, node: DHTNode, peers: list[str], timeout: float) -> set[str]:
    replies = await asyncio.gather(*(_answers(node, peer, timeout) for peer in peers))
    return {peer for peer, answered in zip(peers, replies) if answered}


async def _routing_table_size(dht: DHT, node: DHTNode) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


def connect_peers(dht: DHT, peers: dict[str, list[str]], timeout: float = 10.0) -> dict[str, bool]:
    """Dial each peer (peer id -> addresses) that this island is not connected to; which ones answered."""
    future = dht.run_coroutine(functools.partial(_connect_peers, peers=peers, timeout=timeout), return_future=True)
    return future.result(timeout=timeout + 5)


def connected_peers(dht: DHT, timeout: float = 1.0) -> set[str]:
    """The peers this island's p2pd holds a connection to now (direct or through a relay)."""
    return dht.run_coroutine(_connected_peers, return_future=True).result(timeout=timeout)


def ping_peers(dht: DHT, maddrs: list[str], timeout: float = 10.0) -> int:
    """Dial and DHT-ping each full multiaddr (so that a restarted bootstrap re-learns us); how many answered."""
    future = dht.run_coroutine(functools.partial(_ping_peers, maddrs=maddrs, timeout=timeout), return_future=True)
    return future.result(timeout=timeout + 5)


def routing_table_size(dht: DHT, timeout: float = 10.0) -> int:
    """How many DHT nodes this node knows."""
    return dht.run_coroutine(_routing_table_size, return_future=True).result(timeout=timeout)


def tcp_port(maddrs: list[Any]) -> int | None:
    """The TCP port a p2pd listens on, from its visible multiaddrs."""
    for maddr in maddrs:
        parts = str(maddr).split("/")
        if "tcp" in parts:
            return int(parts[parts.index("tcp") + 1])
    return None


HELLO = "p2p_diloco.hello"
"""A unary handler every node serves outside the DHT's access control: is this swarm private, whose is it."""


async def _serve_hello(dht: DHT, node: DHTNode, answer: bytes) -> None:
    from hivemind.proto import averaging_pb2

    async def hello(request: averaging_pb2.DownloadData, context: Any) -> averaging_pb2.DownloadData:
        return averaging_pb2.DownloadData(metadata=answer)

    await node.p2p.add_protobuf_handler(HELLO, hello, averaging_pb2.DownloadData)


async def _ask_hello(dht: DHT, node: DHTNode, maddrs: list[str], timeout: float) -> list[bytes]:
    from hivemind.proto import averaging_pb2

    async def ask(text: str) -> bytes | None:
        address, peer = split_maddr(text)
        if peer is None or not await _dial(node, peer, [address], timeout):
            return None
        with contextlib.suppress(Exception):
            reply = await asyncio.wait_for(
                node.p2p.call_protobuf_handler(
                    PeerID.from_base58(peer), HELLO, averaging_pb2.DownloadData(), averaging_pb2.DownloadData
                ),
                timeout,
            )
            return reply.metadata
        return None

    return [answer for answer in await asyncio.gather(*map(ask, maddrs)) if answer]


def serve_hello(dht: DHT, answer: dict[str, Any]) -> None:
    """Answer `ask_hello` with `answer` (JSON) from now on."""
    import json

    dht.run_coroutine(functools.partial(_serve_hello, answer=json.dumps(answer).encode()))


def ask_hello(dht: DHT, maddrs: list[str], timeout: float = 10.0) -> list[dict[str, Any]]:
    """What the peers at `maddrs` say about their swarm (those that answer)."""
    import json

    future = dht.run_coroutine(functools.partial(_ask_hello, maddrs=maddrs, timeout=timeout), return_future=True)
    answers = []
    for raw in future.result(timeout=timeout + 5):
        with contextlib.suppress(ValueError):
            if isinstance(answer := json.loads(raw), dict):
                answers.append(answer)
    return answers


async def _revoke(dht: DHT, node: DHTNode, document: Any) -> None:
    authorizer = getattr(node.protocol, "authorizer", None)
    if authorizer is not None and hasattr(authorizer, "membership"):
        authorizer.membership = authorizer.membership.with_revocations(document)


def revoke_in_dht(dht: DHT, document: Any, timeout: float = 10.0) -> None:
    """Apply an owner-signed revocation list to the DHT process's access control."""
    dht.run_coroutine(functools.partial(_revoke, document=document), return_future=True).result(timeout=timeout)
