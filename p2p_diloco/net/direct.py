"""Direct lanes: the tensor parts of one all-reduce between two islands that can reach each other, over plain TCP.

Why: in hivemind's all-reduce every byte goes Python -> unix socket -> p2pd -> (noise, yamux) -> TCP -> p2pd -> unix
socket -> Python, with protobuf copies at each end. On loopback that path moved ~130-150 MB/s per machine and
spent 1.6 CPU-seconds per second of round in the daemons (benchmarks/exchange.py's profile). A lane moves the same
parts over one TCP connection per sender and reducer, straight between the two averager processes, received into
preallocated buffers.

Trust: the reducer hands each sender a one-time ticket over their libp2p connection (authenticated by peer id and
encrypted); the ticket carries the lane's address and a fresh AES-128 key. Every frame is sealed with AES-GCM under
that key with its direction and part index as nonce, so a stranger can neither open a lane, read one, alter a frame
nor replay one out of order: a frame that fails its tag ends the lane and the round treats it as a broken stream.

Fallback: a sender that cannot reach any address of the reducer within CONNECT_S sends over libp2p as before and
does not try that reducer directly again for RETRY_S (a reducer behind NAT, a firewalled port).

Frames, heartbeats and the silence bound of one open lane: `p2p_diloco.net.lane`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hivemind.utils import get_logger
from hivemind.utils.multiaddr import Multiaddr

from p2p_diloco.net.lane import (  # noqa: F401 (re-exported: the lane's names are part of this module's interface)
    FRAME,
    HEARTBEAT,
    HEARTBEAT_S,
    PROTOBUF,
    RAW_FP32,
    SILENCE_S,
    TAG_BYTES,
    TO_REDUCER,
    TO_SENDER,
    Lane,
    LaneError,
    LaneSilent,
    read_exactly,
)
from p2p_diloco.net.pacing import UplinkShare

logger = get_logger(__name__)

MAGIC = b"p2pdl/1\n"
TICKET_BYTES = 16
KEY_BYTES = 16
CONNECT_S = 2.0
"""Longest wait to connect to one address of a reducer before trying the next (then libp2p)."""
HELLO_S = 5.0
"""Longest wait for a connection's hello before the reducer drops it."""
RETRY_S = 300.0
"""After a reducer could not be reached directly, send to it over libp2p for this long before trying again."""
MAX_HOSTS = 8
ENV_OFF = "P2P_DILOCO_DIRECT"


@dataclass
class Ticket:
    """What a reducer remembers of a ticket it issued until the sender presents it."""

    key: bytes
    runner: Any
    sender_index: int
    expires: float


def _socket_for(host: str) -> socket.socket:
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def lane_hosts(maddrs: list[Any]) -> list[str]:
    """The IP addresses among an island's libp2p listen addresses (relayed ones left out), loopback last."""
    hosts: list[str] = []
    for maddr in maddrs:
        text = str(maddr)
        if "p2p-circuit" in text:
            continue
        parts = text.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6") and parts[2] not in hosts:
            hosts.append(parts[2])
    return sorted(hosts, key=lambda host: ipaddress.ip_address(host).is_loopback)


def parse_offer(offer: Any) -> tuple[list[str], int, bytes, bytes] | None:
    """A reducer's ticket offer as (hosts, port, ticket, key), or None when it is not well formed."""
    if not isinstance(offer, dict):
        return None
    hosts, port, ticket, key = offer.get("hosts"), offer.get("port"), offer.get("ticket"), offer.get("key")
    if not (isinstance(port, int) and 0 < port < 65536 and isinstance(hosts, list) and 0 < len(hosts) <= MAX_HOSTS):
        return None
    if not (isinstance(ticket, bytes) and len(ticket) == TICKET_BYTES and isinstance(key, bytes) and len(key) == 16):
        return None
    try:
        valid = [str(ipaddress.ip_address(host)) for host in hosts if isinstance(host, str)]
    except ValueError:
        return None
    return (valid, port, ticket, key) if len(valid) == len(hosts) else None


class DirectLanes:
    """One averager process's lanes: the listening sockets it serves as a reducer, the tickets it issued, and the
    reducers it could not reach (a sender then uses libp2p)."""

    def __init__(self, port: int = 0, uplink_mbit: float = 0.0) -> None:
        self.port = port
        self.share = UplinkShare(uplink_mbit) if uplink_mbit > 0 else None
        """The island's declared upload rate, shared by the lanes sending (`p2p_diloco.net.pacing`); None: unpaced."""
        self._tickets: dict[bytes, Ticket] = {}
        self._unreachable: dict[str, float] = {}
        self._listeners: list[socket.socket] = []
        self._hosts: list[str] = []
        self._server_tasks: list[asyncio.Task] = []

    @staticmethod
    def enabled_by_env() -> bool:
        """False when P2P_DILOCO_DIRECT=off (a test's or a user's switch, beside the config)."""
        return os.environ.get(ENV_OFF, "on").lower() not in ("off", "0", "false", "no")

    async def _ensure_listening(self, maddrs: list[Multiaddr]) -> bool:
        if self._listeners:
            return True
        loop = asyncio.get_running_loop()
        port = self.port
        for host in lane_hosts(maddrs):
            sock = _socket_for(host)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host, port))
                sock.listen(64)
            except OSError as error:  # an announced address that is not this machine's (a public IP behind NAT)
                logger.debug(f"no direct lane on {host}:{port}: {error}")
                sock.close()
                continue
            port = sock.getsockname()[1]  # every address on the same port, the first one's if the system picked it
            self._listeners.append(sock)
            self._hosts.append(host)
            self._server_tasks.append(loop.create_task(self._accept(sock)))
        self.port = port
        if self._listeners:
            logger.info(f"direct lanes listening on port {port} ({', '.join(self._hosts)})")
        return bool(self._listeners)

    async def offer(self, runner: Any, sender_index: int, maddrs: list[Multiaddr], ttl: float) -> dict | None:
        """A one-time ticket for sender `sender_index` of `runner` to open a lane to this reducer, or None when this
        process cannot listen."""
        if not await self._ensure_listening(maddrs):
            return None
        now = time.monotonic()
        for stale in [ticket for ticket, entry in self._tickets.items() if entry.expires < now]:
            del self._tickets[stale]
        ticket, key = secrets.token_bytes(TICKET_BYTES), AESGCM.generate_key(bit_length=8 * KEY_BYTES)
        self._tickets[ticket] = Ticket(key, runner, sender_index, now + ttl)
        return {"hosts": list(self._hosts), "port": self.port, "ticket": ticket, "key": key}

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except (OSError, asyncio.CancelledError):
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            loop.create_task(self._serve(sock))

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        hello = bytearray(len(MAGIC) + TICKET_BYTES)
        try:
            await asyncio.wait_for(read_exactly(loop, sock, memoryview(hello)), HELLO_S)
        except (OSError, asyncio.TimeoutError, LaneError):
            sock.close()
            return
        entry = self._tickets.pop(bytes(hello[len(MAGIC) :]), None) if hello.startswith(MAGIC) else None
        if entry is None or entry.expires < time.monotonic():
            sock.close()  # not ours: a stranger, a replayed or an expired ticket
            return
        lane = Lane(sock, entry.key, outgoing=TO_SENDER)
        try:
            await entry.runner.reduce_from_lane(lane, entry.sender_index)
        finally:
            lane.close()

    def mark_unreachable(self, peer: str) -> None:
        """Send to this reducer over libp2p for the next RETRY_S."""
        self._unreachable[peer] = time.monotonic() + RETRY_S

    def reachable(self, peer: str) -> bool:
        """Whether to try a lane to this reducer (not after a recent failure)."""
        return self._unreachable.get(peer, 0.0) < time.monotonic()

    @property
    def paced(self) -> bool:
        """Whether lanes share a declared uplink (and members send their own parts before their replies)."""
        return self.share is not None

    async def connect(self, peer: str, offer: Any) -> Lane | None:
        """A lane to the reducer that made `offer`, or None (remembered for RETRY_S) when none of its addresses
        answers."""
        parsed = parse_offer(offer)
        if parsed is None:
            return None
        hosts, port, ticket, key = parsed
        loop = asyncio.get_running_loop()
        for host in hosts:
            sock = _socket_for(host)
            try:
                await asyncio.wait_for(loop.sock_connect(sock, (host, port)), CONNECT_S)
                await asyncio.wait_for(loop.sock_sendall(sock, MAGIC + ticket), CONNECT_S)
            except (OSError, asyncio.TimeoutError):
                sock.close()
                continue
            return Lane(sock, key, outgoing=TO_REDUCER)
        self.mark_unreachable(peer)
        logger.info(f"no direct lane to {peer} ({', '.join(hosts)} port {port}): sending over libp2p")
        return None

    def close(self) -> None:
        """Stop listening."""
        for task in self._server_tasks:
            task.cancel()
        for sock in self._listeners:
            sock.close()
        self._listeners.clear()
