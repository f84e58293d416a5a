"""A leader starts its group without the followers whose wait for the go ends before the go can reach them."""

from __future__ import annotations

import asyncio

from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time

from p2p_diloco.net.departing_followers import (
    DEPARTURE_MARGIN_S,
    StartWithoutDepartingFollowers,
    start_without_departing_followers,
)


class LeaderMatchmaking:
    """A stand-in for hivemind's Matchmaking as a leader sees it: accepted followers' join requests, and an
    assembly that groups whoever is still among them."""

    request_timeout = 0.8

    def __init__(self, expirations: dict[str, float]) -> None:
        self.current_followers = {
            peer: averaging_pb2.JoinRequest(expiration=expiration) for peer, expiration in expirations.items()
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
