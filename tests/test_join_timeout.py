"""A join request to a leader that never opens its stream (a frozen island) gives up; other streams are untouched."""

from __future__ import annotations

import asyncio

import pytest

from p2p_diloco.net.join_timeout import OPEN_TIMEOUT_MIN_S, BoundedJoinRequests, bound_join_requests


class FrozenLeaders:
    """A stand-in for hivemind's P2P: opening any stream hangs until released, as toward a SIGSTOPped p2pd."""

    def __init__(self) -> None:
        self.released = asyncio.Event()
        self.opened: list[str] = []

    async def iterate_protobuf_handler(self, peer_id, name, requests, output_type):
        await self.released.wait()
        self.opened.append(name)
        return f"stream {name}"


def test_a_join_to_a_frozen_leader_times_out_and_other_streams_wait() -> None:
    async def run() -> None:
        p2p = FrozenLeaders()
        bounded = BoundedJoinRequests(p2p, timeout=0.05)
        with pytest.raises(asyncio.TimeoutError):  # what hivemind's matchmaking takes as a silent leader
            await bounded("leader", "averager::DecentralizedAverager.rpc_join_group", None, None)
        other = asyncio.create_task(bounded("peer", "averager::DecentralizedAverager.rpc_aggregate_part", None, None))
        await asyncio.sleep(0.1)  # longer than the join's bound: an all-reduce stream is never cut short
        assert not other.done()
        p2p.released.set()
        assert await other == "stream averager::DecentralizedAverager.rpc_aggregate_part"
        assert await bounded("leader", "x.rpc_join_group", None, None) == "stream x.rpc_join_group"

    asyncio.run(run())


def test_bounding_is_idempotent_and_never_below_the_floor() -> None:
    p2p = FrozenLeaders()
    original = p2p.iterate_protobuf_handler
    first = bound_join_requests(p2p, 0.5)
    assert first.timeout == OPEN_TIMEOUT_MIN_S and p2p.iterate_protobuf_handler is first
    second = bound_join_requests(p2p, 30.0)
    assert second is first and first.timeout == 30.0
    assert first._iterate == original  # not wrapped twice
