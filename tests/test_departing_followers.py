"""A leader starts its group without the followers whose wait for the go ends before the go can reach them."""

from __future__ import annotations

import asyncio

from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time

from p2p_diloco.net.departing_followers import (
    DEADLINE_GATHER_KEY,
    DEPARTURE_MARGIN_S,
    StartWithoutDepartingFollowers,
    start_without_departing_followers,
    told_deadline,
)


class LeaderMatchmaking:
    """A stand-in for hivemind's Matchmaking as a leader sees it: accepted followers' join requests, and an
    assembly that groups whoever is still among them."""

    request_timeout = 0.8

    def __init__(self, expirations: dict[str, float], gathers: dict[str, bytes] | None = None) -> None:
        gathers = gathers or {}
        self.current_followers = {
            peer: averaging_pb2.JoinRequest(expiration=expiration, gather=gathers.get(peer, b""))
            for peer, expiration in expirations.items()
        }

    async def leader_assemble_group(self) -> list[str]:
        return sorted([*self.current_followers, "leader"])


def test_a_follower_whose_wait_has_ended_or_is_about_to_is_left_out_of_the_group() -> None:
    now = get_dht_time()
    timeout = LeaderMatchmaking.request_timeout
    matchmaking = LeaderMatchmaking(
        {
            "waits-on": now + 1.0,  # expires later than the leader: waits 1.8 s more
            "just-in-time": now - timeout + DEPARTURE_MARGIN_S + 0.5,  # its wait ends in 0.5 s: the go reaches it
            "about-to-leave": now - timeout + DEPARTURE_MARGIN_S / 2,  # ends before the go can arrive
            "gone": now - timeout - 0.3,  # stopped waiting 0.3 s ago: its closed stream is still on the way
        }
    )
    start = start_without_departing_followers(matchmaking)
    group = asyncio.run(matchmaking.leader_assemble_group())
    assert group == ["just-in-time", "leader", "waits-on"]
    assert start.left_out == 2 and set(matchmaking.current_followers) == {"waits-on", "just-in-time"}


def test_installing_twice_wraps_once() -> None:
    matchmaking = LeaderMatchmaking({})
    first = start_without_departing_followers(matchmaking)
    assert isinstance(first, StartWithoutDepartingFollowers)
    assert start_without_departing_followers(matchmaking) is first
    assert asyncio.run(matchmaking.leader_assemble_group()) == ["leader"]


def gather_of(metadata: object) -> bytes:
    """A join request's gather as hivemind's averager builds it around an island's metadata."""
    return MSGPackSerializer.dumps([1.0, 0, MSGPackSerializer.dumps(metadata)])


def test_a_follower_whose_step_ends_before_its_request_would_is_left_out() -> None:
    # A second declaration runs up to the step's deadline, so the request's bound (expiration + request_timeout)
    # lies request_timeout past the moment the follower stops waiting (seen in chaos runs: it left at 2.0 s).
    now = get_dht_time()
    expiration = now + 0.1  # hivemind's bound: 0.9 s from now, the go would reach it
    matchmaking = LeaderMatchmaking(
        {
            "steps-out": expiration,
            "epoch": expiration,
            "steps-on": expiration,
            "stock": expiration,
            "garbled": expiration,
        },
        {
            "steps-out": gather_of({DEADLINE_GATHER_KEY: expiration, "outer_step": 3}),  # leaves in 0.1 s
            "epoch": gather_of({DEADLINE_GATHER_KEY: 0.0}),  # a deadline long past, though it reads as false
            "steps-on": gather_of({DEADLINE_GATHER_KEY: now + 5.0}),  # its request's own bound still holds
            "stock": gather_of({"outer_step": 3}),  # states no deadline: hivemind's bound
            "garbled": b"\x00not msgpack",
        },
    )
    start = start_without_departing_followers(matchmaking)
    group = asyncio.run(matchmaking.leader_assemble_group())
    assert group == ["garbled", "leader", "steps-on", "stock"] and start.left_out == 2


def test_a_stated_deadline_is_read_only_when_it_is_a_finite_number() -> None:
    assert told_deadline(gather_of({DEADLINE_GATHER_KEY: 12.5})) == 12.5
    assert told_deadline(gather_of({DEADLINE_GATHER_KEY: 12})) == 12.0
    for lie in (float("nan"), float("inf"), True, "soon", None, [1.0]):
        assert told_deadline(gather_of({DEADLINE_GATHER_KEY: lie})) is None, lie
    assert told_deadline(gather_of([DEADLINE_GATHER_KEY])) is None and told_deadline(b"") is None
