"""Paced lanes (`--uplink-mbit`): each lane's share of the uplink, the socket options, and replies held until a
member's own parts are out."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from p2p_diloco.net.lane_parts import LanePartsMixin
from p2p_diloco.net.pacing import (
    MIN_UNSENT,
    SO_MAX_PACING_RATE,
    OwnPartsOut,
    UplinkShare,
    lane_rate,
    pace_socket,
)


def test_lanes_share_the_declared_uplink_evenly_just_below_it() -> None:
    one = lane_rate(100, 1)
    assert 0.95 * 12.5e6 <= one < 12.5e6
    assert lane_rate(100, 3) == pytest.approx(one / 3, abs=1)
    assert lane_rate(100, 0) == one  # a member with no remote reducer still gets a positive rate


@pytest.fixture
def connected() -> tuple[socket.socket, socket.socket]:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    listener.close()
    yield client, server
    client.close()
    server.close()


def test_a_paced_socket_keeps_its_rate_and_little_unsent(connected) -> None:
    client, _ = connected
    assert pace_socket(client, 3_000_000)
    assert client.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE) == 3_000_000
    assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT) == max(MIN_UNSENT, 30_000)
    assert pace_socket(client, 100_000_000)
    assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT) == 1_000_000


def test_a_paced_socket_sends_no_faster_than_its_rate(connected) -> None:
    client, server = connected
    pace_socket(client, 4_000_000)
    payload = bytes(4_000_000)
    sending = threading.Thread(target=client.sendall, args=(payload,))
    sending.start()
    received, started = 0, None
    while received < len(payload):
        received += len(server.recv(1 << 20))
        if started is None and received >= 1_000_000:  # past the first flight, which leaves at once
            started, first = time.monotonic(), received
    sending.join()
    # A lower bound only: a loaded machine can make it slower, never faster than the pace allows.
    assert time.monotonic() - started >= 0.8 * (len(payload) - first) / 4_000_000


def test_the_lanes_sending_at_the_moment_share_the_uplink_evenly() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    clients = [socket.create_connection(listener.getsockname()) for _ in range(3)]
    servers = [listener.accept()[0] for _ in clients]
    try:
        share = UplinkShare(100)

        def rates() -> list[int]:
            return [client.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE) for client in clients]

        for client in clients:
            share.start(client)
        assert rates() == [lane_rate(100, 3)] * 3
        share.stop(clients[0])  # done with its parts: the two still sending take its share
        assert rates()[1:] == [lane_rate(100, 2)] * 2
        clients[1].close()  # closed under the share (a broken lane): forgotten, the last one sends alone
        share.start(clients[0])
        share.stop(clients[0])
        assert clients[2].getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE) == lane_rate(100, 1)
    finally:
        for sock in [listener, *clients, *servers]:
            sock.close()


class _Member(LanePartsMixin):
    """A runner's reply side alone: the frames it sends are recorded."""

    def __init__(self, reducers: list[int]) -> None:
        self.own_parts = OwnPartsOut(reducers)
        self.lanes = None  # unpaced: the hold alone is under test here
        self.sender_timeout = 5.0
        self.sent: list[int] = []

    async def _send_frame(self, lane, index, kind, payload, weight, timeout) -> None:
        self.sent.append(index)


def test_replies_wait_until_the_members_own_parts_are_out_then_leave_in_order() -> None:
    async def scenario() -> list[list[int]]:
        member = _Member([1, 2])
        replies: asyncio.Queue = asyncio.Queue()
        writer = asyncio.create_task(member._write_replies(None, replies))
        seen = []
        for index in range(3):
            replies.put_nowait((index, 0, b""))
        await asyncio.sleep(0.05)
        seen.append(list(member.sent))
        member.own_parts.done(1)
        await asyncio.sleep(0.05)
        seen.append(list(member.sent))
        member.own_parts.done(2)  # the last reducer's parts are out (or its send failed)
        replies.put_nowait((3, 0, b""))
        replies.put_nowait(None)
        await asyncio.wait_for(writer, 5)
        seen.append(list(member.sent))
        return seen

    assert asyncio.run(scenario()) == [[], [], [0, 1, 2, 3]]


def test_a_lost_round_or_a_member_with_nothing_to_send_holds_nothing_back() -> None:
    async def scenario() -> tuple[bool, bool, bool]:
        idle = OwnPartsOut([])
        lost = OwnPartsOut([0, 3])
        lost.release()  # the round is doomed: its poisoned replies must leave at once
        partial = OwnPartsOut([0, 3])
        partial.done(3)
        partial.done(3)
        return idle.event.is_set(), lost.event.is_set(), partial.event.is_set()

    assert asyncio.run(scenario()) == (True, True, False)


def test_an_islands_declared_uplink_reaches_its_exchange(monkeypatch) -> None:
    from p2p_diloco.config import NetworkConfig
    from p2p_diloco.island import link

    made = {}
    monkeypatch.setattr(link, "GossipExchange", lambda dht, **options: made.update(options))
    network = NetworkConfig(uplink_mbit=80.0)
    link.network_exchange(None, network, None, size=16, state_provider=lambda **_: ({}, []), client_mode=False)
    assert made["uplink_mbit"] == 80.0 and made["direct_lanes"] is True
