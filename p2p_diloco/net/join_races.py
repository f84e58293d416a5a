"""Join requests that would leave a follower behind: two islands asking each other, or a request that outwaited its
asker.

hivemind's matchmaking answers a join request only while holding the lock that its own outgoing request holds until
its candidate leader answers, and an asker gives up after `request_timeout` without a first answer
(`Matchmaking._request_join_group`). Islands pick a leader by the expiration they read from the DHT, which can be a
step old: two islands may then ask each other at once, each one's answer waits for the other's, and both give up
after `request_timeout` (hivemind's Matchmaking docstring: "we simply break them with request_timeout"). The first
to get its lock back then accepts the other's request, whose asker has left, and starts a group with it: every
member waits for its parts and loses the round (tests/test_join_races.py runs it on hivemind's own code). Here a
request hivemind will refuse by its expiration order is refused before the lock, so one of the two asks is answered
at once and the other is then accepted in time, and a request accepted only after its asker's `request_timeout` is
refused instead, before hivemind starts a group with it.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from typing import Any

from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_logger

logger = get_logger(__name__)

STALE_MARGIN_S = 0.1
"""A request accepted this close to its asker's `request_timeout` (or later) is refused: the acceptance would reach
an asker that has left, or is about to."""


def asks_out_of_order(request: averaging_pb2.JoinRequest, matchmaking: Any) -> bool:
    """True when the asker's expiration comes before ours: hivemind refuses it (BAD_EXPIRATION_TIME), as it should
    lead us, but only once it holds its join lock."""
    ours = matchmaking.potential_leaders.declared_expiration_time
    return math.isfinite(ours) and ours > request.expiration


async def join_responses(
    matchmaking: Any,
    request: averaging_pb2.JoinRequest,
    asker: PeerID,
    responses: AsyncIterator[averaging_pb2.MessageFromLeader],
) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
    """hivemind's answers to a join request (`responses`), unless the asker should lead us or has waited too long."""
    arrived = time.monotonic()
    if matchmaking.is_looking_for_group and asks_out_of_order(request, matchmaking):
        # hivemind's answer, given before our join lock rather than after: when we are asking the asker to lead
        # (both read the other's expiration a step old), our lock stays held until it answers, and it cannot.
        logger.debug(f"{asker} asked to follow this island, which expires later: refused at once")
        await responses.aclose()
        yield averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_EXPIRATION_TIME)
        return
    async for response in responses:
        waited = time.monotonic() - arrived
        if response.code == averaging_pb2.ACCEPTED and waited > matchmaking.request_timeout - STALE_MARGIN_S:
            # Taken in while the lock was held by others; hivemind has not started a group with it yet (it does
            # after this answer): closing its handler here drops it from the followers.
            logger.info(f"refused {asker} as a follower: its request waited {waited:.2f} s, past its timeout")
            await responses.aclose()
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
            return
        yield response
