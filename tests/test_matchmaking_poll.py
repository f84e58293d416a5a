"""The paced leader search: DHT look-ups of the group key spaced by network.leader_poll_s, on a real DHT."""

from __future__ import annotations

import asyncio
import time

import pytest
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.utils import get_dht_time

from p2p_diloco.net.dht import shutdown_dht, start_dht
from p2p_diloco.net.matchmaking_poll import FIRST_GAP_S, PacedLookups, pace_lookups


@pytest.fixture(scope="module")
def dht():
    node = start_dht(
        initial_peers=[], host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[], identity=None, timeout=30
    )
    yield node
    shutdown_dht(node)


def _search(manager: GroupKeyManager, peer, lookups: int) -> tuple[list, list[float]]:
    """Declare `peer` under the group key, then look the key up `lookups` times; what was found and when."""

    async def run() -> tuple[list, list[float]]:
        await manager.declare_averager(manager.current_key, peer, expiration_time=get_dht_time() + 30)
        found, times = [], []
        for _ in range(lookups):
            found = await manager.get_averagers(manager.current_key, only_active=True)
            times.append(time.monotonic())
        return found, times

    return asyncio.run(run())


class RecordingKeys:
    """A key manager's get_averagers that notes when each look-up starts (the DHT's answer time varies)."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    async def get_averagers(self, group_key: str, only_active: bool) -> list:
        self.starts.append(time.monotonic())
        await asyncio.sleep(0.01)  # a look-up's round trip
        return []


def test_look_ups_start_at_growing_gaps_up_to_the_poll_interval() -> None:
    keys = RecordingKeys()
    paced = pace_lookups(keys, 0.1)
    assert isinstance(paced, PacedLookups) and pace_lookups(keys, 0.1) is paced  # never wrapped twice

    async def search() -> None:
        for _ in range(7):
            await keys.get_averagers("run.0b", only_active=True)

    asyncio.run(search())
    gaps = [later - earlier for earlier, later in zip(keys.starts, keys.starts[1:])]
    floors = [FIRST_GAP_S, 2 * FIRST_GAP_S, 4 * FIRST_GAP_S, 0.1, 0.1, 0.1]  # 0.02, 0.04, 0.08, then the cap
    assert all(gap >= floor - 1e-3 for gap, floor in zip(gaps, floors)), gaps
    assert max(gaps) < 0.5, gaps  # capped: doubling on would reach 0.64 s; the rest is room for a loaded machine
    assert paced.lookups == 7


def test_a_paced_search_still_finds_the_declared_leader(dht) -> None:
    manager = GroupKeyManager(dht, "paced", initial_group_bits="", target_group_size=4)
    paced = pace_lookups(manager, 0.3)
    found, _ = _search(manager, dht.peer_id, lookups=3)
    assert [peer for peer, _ in found] == [dht.peer_id]
    assert paced.lookups == 3


def test_a_new_search_starts_with_a_short_gap_again(dht) -> None:
    manager = GroupKeyManager(dht, "restarted", initial_group_bits="", target_group_size=4)
    paced = pace_lookups(manager, 0.5)
    _search(manager, dht.peer_id, lookups=6)  # the gap has grown to the cap
    pace_lookups(manager, 0.5)  # what the averager does when a round's search begins
    started = time.monotonic()
    _, times = _search(manager, dht.peer_id, lookups=2)
    assert times[-1] - started < 0.5  # two look-ups inside what one capped gap would take
    assert paced.lookups == 8


def test_a_zero_interval_keeps_hivemind_s_pace(dht) -> None:
    manager = GroupKeyManager(dht, "unpaced", initial_group_bits="", target_group_size=4)
    assert pace_lookups(manager, 0) is None
    assert not isinstance(manager.get_averagers, PacedLookups)
    found, _ = _search(manager, dht.peer_id, lookups=2)
    assert [peer for peer, _ in found] == [dht.peer_id]
