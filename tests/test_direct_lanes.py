"""Direct lanes: sealed frames, tickets, offers, and groups that mix lanes with libp2p streams."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time

import pytest
import torch
from members import Members
from test_allreduce import _true_mean

from p2p_diloco.net.direct import (
    FRAME,
    MAGIC,
    PROTOBUF,
    RAW_FP32,
    TO_REDUCER,
    TO_SENDER,
    DirectLanes,
    Lane,
    LaneError,
    lane_hosts,
    parse_offer,
)

KEY = bytes(range(16))


async def _pair() -> tuple[Lane, Lane, socket.socket, socket.socket]:
    left, right = socket.socketpair()
    for sock in (left, right):
        sock.setblocking(False)
    return Lane(left, KEY, outgoing=TO_REDUCER), Lane(right, KEY, outgoing=TO_SENDER), left, right


def test_frames_travel_sealed_both_ways_and_count_their_bytes() -> None:
    async def scenario() -> None:
        sender, reducer, _, _ = await _pair()
        values = torch.arange(1000, dtype=torch.float32)
        view = memoryview(values.numpy()).cast("B")
        assert await sender.send(0, RAW_FP32, view, weight=2.5) == 4000
        kind, weight, payload = await reducer.receive(0, 4000)
        assert (kind, weight) == (RAW_FP32, 2.5)
        assert torch.equal(payload.view(torch.float32), values)
        await reducer.send(0, PROTOBUF, b"averaged")
        kind, _, payload = await sender.receive(0, 100, into=torch.empty(64, dtype=torch.uint8))
        assert kind == PROTOBUF and bytes(payload.numpy()) == b"averaged"
        assert sender.bytes_sent == reducer.bytes_received == FRAME.size + 4000 + 16
        assert reducer.bytes_sent == sender.bytes_received == FRAME.size + 8 + 16

    asyncio.run(scenario())


def test_a_tampered_frame_fails_its_tag() -> None:
    async def scenario() -> None:
        _, reducer, left, _ = await _pair()
        # A frame sealed with another key (a stranger who learned the ticket but not the key).
        await Lane(left, bytes(16), outgoing=TO_REDUCER).send(0, RAW_FP32, b"\x00" * 8, 1.0)
        with pytest.raises(LaneError, match="authentication tag"):
            await reducer.receive(0, 8)
        # A good frame whose header was changed in transit (its weight): the header is authenticated too.
        sender, _, _, right = await _pair()
        await sender.send(0, RAW_FP32, b"\x01" * 8, 1.0)
        right.setblocking(True)
        frame = bytearray(right.recv(1024))
        frame[: FRAME.size] = FRAME.pack(0, RAW_FP32, 8, 1e9)
        inbound, outbound = socket.socketpair()
        outbound.sendall(bytes(frame))
        inbound.setblocking(False)
        with pytest.raises(LaneError, match="authentication tag"):
            await Lane(inbound, KEY, outgoing=TO_SENDER).receive(0, 8)

    asyncio.run(scenario())


def test_frames_out_of_order_or_too_large_end_the_lane() -> None:
    async def scenario() -> None:
        sender, reducer, _, _ = await _pair()
        await sender.send(1, RAW_FP32, b"\x00" * 8)
        with pytest.raises(LaneError, match="expected part 0"):
            await reducer.receive(0, 8)
        sender, reducer, _, _ = await _pair()
        await sender.send(0, RAW_FP32, b"\x00" * 64)
        with pytest.raises(LaneError, match="64 bytes"):
            await reducer.receive(0, 32)
        sender, reducer, left, _ = await _pair()
        left.close()
        with pytest.raises(LaneError, match="closed"):
            await reducer.receive(0, 8)

    asyncio.run(scenario())


class _Runner:
    """Stands in for an all-reduce runner: records which sender's lane reached it."""

    def __init__(self) -> None:
        self.lanes: list[int] = []

    async def reduce_from_lane(self, lane: Lane, sender_index: int) -> None:
        self.lanes.append(sender_index)
        kind, weight, payload = await lane.receive(0, 16)
        await lane.send(0, kind, bytes(payload.numpy()), 0.0)


def test_only_a_ticket_opens_a_lane_and_only_once() -> None:
    async def scenario() -> None:
        lanes = DirectLanes()
        runner = _Runner()
        offer = await lanes.offer(runner, 3, ["/ip4/127.0.0.1/tcp/1"], ttl=30.0)
        assert offer is not None and offer["hosts"] == ["127.0.0.1"]
        loop = asyncio.get_running_loop()

        async def stranger(hello: bytes) -> bytes:
            sock = socket.create_connection(("127.0.0.1", offer["port"]))
            sock.setblocking(False)
            await loop.sock_sendall(sock, hello)
            try:
                return await asyncio.wait_for(loop.sock_recv(sock, 16), 5.0)  # b"": dropped
            except ConnectionResetError:  # dropped with our bytes unread
                return b""
            finally:
                sock.close()

        assert await stranger(MAGIC + bytes(16)) == b""  # a ticket never issued
        assert await stranger(b"GET / HTTP/1.1\r\n\r\n" + bytes(8)) == b""  # not our protocol
        lane = await lanes.connect("reducer", offer)
        assert lane is not None
        await lane.send(0, PROTOBUF, b"hello", 1.0)
        kind, _, payload = await lane.receive(0, 16)
        assert bytes(payload.numpy()) == b"hello" and runner.lanes == [3]
        lane.close()
        replayed = await lanes.connect("reducer", offer)
        assert replayed is not None  # the TCP connection opens...
        with pytest.raises((LaneError, ConnectionResetError)):
            await asyncio.wait_for(replayed.receive(0, 16), 5.0)  # ...and is dropped: a used ticket reaches no runner
        assert runner.lanes == [3]
        lanes.close()

    asyncio.run(scenario())


def test_an_unreachable_reducer_is_remembered() -> None:
    async def scenario() -> None:
        lanes = DirectLanes()
        with socket.socket() as probe:  # a port nothing listens on
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        offer = {"hosts": ["127.0.0.1"], "port": port, "ticket": bytes(16), "key": bytes(16)}
        assert lanes.reachable("reducer")
        assert await lanes.connect("reducer", offer) is None
        assert not lanes.reachable("reducer") and lanes.reachable("another")

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "offer",
    [
        None,
        [],
        {"hosts": ["127.0.0.1"], "port": 0, "ticket": bytes(16), "key": bytes(16)},
        {"hosts": ["127.0.0.1"], "port": 70000, "ticket": bytes(16), "key": bytes(16)},
        {"hosts": ["example.com"], "port": 1, "ticket": bytes(16), "key": bytes(16)},
        {"hosts": [], "port": 1, "ticket": bytes(16), "key": bytes(16)},
        {"hosts": ["10.0.0.1"] * 9, "port": 1, "ticket": bytes(16), "key": bytes(16)},
        {"hosts": ["127.0.0.1"], "port": 1, "ticket": bytes(15), "key": bytes(16)},
        {"hosts": ["127.0.0.1"], "port": 1, "ticket": bytes(16), "key": "k" * 16},
        {"hosts": [7], "port": 1, "ticket": bytes(16), "key": bytes(16)},
    ],
)
def test_a_malformed_offer_is_refused(offer) -> None:
    assert parse_offer(offer) is None


def test_lane_hosts_leave_out_relayed_addresses_and_put_loopback_last() -> None:
    maddrs = [
        "/ip4/127.0.0.1/tcp/4001/p2p/QmA",
        "/ip4/10.1.2.3/tcp/4001/p2p/QmA",
        "/ip4/10.9.9.9/tcp/4001/p2p/QmR/p2p-circuit/p2p/QmA",
        "/ip6/::1/tcp/4001",
        "/ip4/10.1.2.3/udp/4001/quic-v1",
    ]
    assert lane_hosts(maddrs) == ["10.1.2.3", "127.0.0.1", "::1"]
    assert struct.calcsize("<IBQd") == FRAME.size


def test_a_group_mixes_lanes_and_libp2p_and_ends_with_identical_bits(members: Members) -> None:
    # Member 3 has lanes off (an older or firewalled island): parts to and from it go over libp2p, the others'
    # over lanes; every member merges the same, exact mean.
    size, seeds = 400_000, [61, 62, 63]
    first = members.start(seeds[0], size, 3, [], "--chunk-timeout", "10")
    members.start(seeds[1], size, 3, [first.maddr], "--chunk-timeout", "10")
    members.start(seeds[2], size, 3, [first.maddr], "--chunk-timeout", "10", "--lanes", "off")
    members.go()
    results = [members.result(process) for process in members.processes]
    assert all(result["merged"] is not None for result in results), results
    mean = _true_mean(seeds, size)
    for result in results:
        torch.testing.assert_close(torch.tensor(result["merged"]["first"]), mean[:4], atol=1e-6, rtol=0)
    assert len({json.dumps(result["merged"]) for result in results}) == 1, "members ended with different bits"
    # One lane per attempt: hivemind retries a failed all-reduce with a new group (allow_retries), as on a busy CI
    # host once ([2, 2, 0]); member 3 never opens one, the others do on every attempt that reaches the parts.
    lanes = [result["lanes"] for result in results]
    assert lanes[2] == 0 and min(lanes[:2]) >= 1, lanes


def test_a_sender_that_takes_a_ticket_and_never_connects_is_banned_before_the_timeout(
    members: Members, tmp_path
) -> None:
    # A ticket counts its sender as started, so hivemind's missing-sender check no longer covers it: a sender frozen
    # between its ticket and its connect must cost the round its sender timeout, not the 30 s all-reduce timeout.
    size, seeds = 1_200_000, [71, 72, 73]  # every member reduces a share
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    first = members.start(seeds[0], size, 3, [], "--timeout", "12", log=logs[0])
    second = members.start(seeds[1], size, 3, [first.maddr], "--timeout", "12", log=logs[1])
    frozen = members.start(seeds[2], size, 3, [first.maddr], "--timeout", "12", "--freeze-after-ticket")
    started = time.monotonic()
    members.go()
    results = [members.result(process) for process in (first, second)]
    elapsed = time.monotonic() - started
    assert all(result["merged"] is None and result["restored"] for result in results), results
    assert elapsed < 25, f"the survivors waited {elapsed:.0f} s: the frozen sender was not banned"
    frozen_id = frozen.maddr.split("/p2p/")[-1]
    banned = [f"sender {frozen_id} took a lane ticket but never connected" in log.read_text() for log in logs]
    # A survivor whose round already failed another way (its own parts to the frozen reducer) has nothing left to
    # ban for, and on a loaded machine that can come first (CI: [False, True]); the round's end above is the
    # guarantee, and the sender is named by a reducer that was still waiting for it.
    assert any(banned), f"no survivor's reducer named the frozen sender: {banned}"
