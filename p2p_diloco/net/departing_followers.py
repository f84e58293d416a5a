"""A leader that starts its group without the followers about to stop waiting for it.

A follower that hivemind's leader accepted waits for the go (BEGIN_ALLREDUCE) until its declared expiration plus
`request_timeout`, then leaves (`Matchmaking._request_join_group`). A leader starts at its own expiration, no
later than its followers' (it refuses one that expires sooner), but a leader caught in a join request of its own to
another candidate starts up to `request_timeout` late: the two deadlines race. A follower that lost the race has
left while its closed stream is still on the way, the leader starts with it, and every other member loses the
round once it never comes. Measured in benchmarks/chaos.py, in a run without faults: four islands waited 6.1 s
for a round that failed ("no lane ticket" from the fifth), and the fifth, which had given up at 2.0 s, found no
group. Left out at assembly, such a follower alone loses its round, as it would anyway.

A follower also leaves at its step's deadline (`look_for_group` waits for a group no longer), which hivemind does not
send: once a first declaration expired unmatched, the next is declared up to that deadline, and the follower then
leaves `request_timeout` before the bound the leader reads from its request. Islands send their deadline in the
gathered metadata (DEADLINE_GATHER_KEY); a peer that lies about it can only get itself left out.
"""

from __future__ import annotations

from math import isfinite
from typing import Any

from hivemind.utils import get_dht_time, get_logger

from p2p_diloco.net.gathered import island_metadata

logger = get_logger(__name__)

DEPARTURE_MARGIN_S = 0.25
"""A follower whose wait ends sooner than this after the group forms is left out: the go must still reach it."""
DEADLINE_GATHER_KEY = "search_deadline"
"""Gathered metadata: the DHT time at which this island's averaging step stops waiting for a group."""


def told_deadline(gather: bytes) -> float | None:
    """The step deadline a follower's join request states (DEADLINE_GATHER_KEY), or None if it states none."""
    deadline = island_metadata(gather).get(DEADLINE_GATHER_KEY)  # none stated: hivemind's own bound then
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not isfinite(deadline):
        return None
    return float(deadline)


class StartWithoutDepartingFollowers:
    """`Matchmaking.leader_assemble_group` of one averager, leaving out the followers about to give up."""

    def __init__(self, matchmaking: Any):
        self._matchmaking = matchmaking
        self._assemble = matchmaking.leader_assemble_group
        self.left_out = 0

    async def __call__(self) -> Any:
        """Drop the followers whose wait ends within DEPARTURE_MARGIN_S, then assemble as hivemind does."""
        matchmaking = self._matchmaking
        now = get_dht_time()
        for peer, request in list(matchmaking.current_followers.items()):
            # The follower's own bounds: its declared expiration plus request_timeout (_request_join_group), and its
            # step's deadline (look_for_group) where it told it.
            ends = request.expiration + matchmaking.request_timeout
            told = told_deadline(request.gather)
            ends_in = (ends if told is None else min(ends, told)) - now
            if ends_in < DEPARTURE_MARGIN_S:
                # Its rpc_join_group sees it missing from the group and tells it GROUP_DISBANDED, if it still listens.
                del matchmaking.current_followers[peer]
                self.left_out += 1
                logger.info(f"left {peer} out of the group: it stops waiting for the go in {ends_in:.2f} s")
        return await self._assemble()


def start_without_departing_followers(matchmaking: Any) -> StartWithoutDepartingFollowers:
    """Make `matchmaking`'s leader leave out followers about to give up from now on (idempotent)."""
    if isinstance(matchmaking.leader_assemble_group, StartWithoutDepartingFollowers):
        return matchmaking.leader_assemble_group
    # An instance attribute, not a subclass: hivemind builds Matchmaking inside the averager's own process and offers
    # no hook to pass another class (as for net/withdrawals.py); its callers look the method up on the instance.
    wrapped = StartWithoutDepartingFollowers(matchmaking)
    matchmaking.leader_assemble_group = wrapped
    return wrapped
