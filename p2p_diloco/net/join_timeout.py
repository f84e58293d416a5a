"""A bounded join request: hivemind opens the stream to a would-be group leader with no timeout.

`Matchmaking._request_join_group` bounds each message from the leader by `request_timeout`, but not the opening of
the stream before the first one, and it opens that stream holding the lock that serialises an island's join
requests. A leader whose process and p2pd are frozen (SIGSTOP, a suspended VM, a closed laptop lid) leaves the
open pending, so every island that picked it as leader waits out its whole round and the round fails for all of
them: in `benchmarks/chaos.py` each SIGSTOP of one island cost the four others a failed 7.5 s round. Bounded, a
join to a frozen leader fails as a silent leader's does, and the island retries with the next leader or leads.
"""

from __future__ import annotations

import asyncio
from typing import Any

JOIN_HANDLER = "rpc_join_group"
"""The suffix of hivemind's join-request handler name (`{namespace}::{servicer}.rpc_join_group`)."""
OPEN_TIMEOUT_MIN_S = 2.0
"""Least time a join stream gets to open: on a loaded machine or a slow, relayed link opening a stream can take
several round trips, and cutting an honest join short costs a round as surely as a frozen leader does."""


class BoundedJoinRequests:
    """`P2P.iterate_protobuf_handler` of one averager, with join-request streams bounded in how long they open."""

    def __init__(self, p2p: Any, timeout: float):
        self._iterate = p2p.iterate_protobuf_handler
        self.timeout = timeout

    async def __call__(self, peer_id: Any, name: str, requests: Any, output_type: Any) -> Any:
        """Open the stream as hivemind would; a join request's open gives up after `timeout` (asyncio.TimeoutError,
        which hivemind's matchmaking treats as a leader that did not answer)."""
        opening = self._iterate(peer_id, name, requests, output_type)
        if not name.endswith(JOIN_HANDLER):
            return await opening
        return await asyncio.wait_for(opening, self.timeout)


def bound_join_requests(p2p: Any, request_timeout: float) -> BoundedJoinRequests:
    """Bound how long `p2p` takes to open a join-request stream: request_timeout, at least OPEN_TIMEOUT_MIN_S."""
    timeout = max(request_timeout, OPEN_TIMEOUT_MIN_S)
    if isinstance(p2p.iterate_protobuf_handler, BoundedJoinRequests):
        p2p.iterate_protobuf_handler.timeout = timeout
        return p2p.iterate_protobuf_handler
    # An instance attribute, not a subclass: the P2P object is hivemind's, made by the DHT and shared with the
    # averager, and Matchmaking calls it through a stub with no hook for a timeout on stream-returning handlers.
    bounded = BoundedJoinRequests(p2p, timeout)
    p2p.iterate_protobuf_handler = bounded
    return bounded
