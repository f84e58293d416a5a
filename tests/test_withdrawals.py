"""A search for a group ends without waiting for its withdrawal from the DHT (a frozen DHT node answers late)."""

from __future__ import annotations

import asyncio

from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from p2p_diloco.net.withdrawals import DetachedWithdrawals, detach_withdrawals


class FrozenDHTKeys:
    """A stand-in for hivemind's GroupKeyManager: every store hangs until released, as with a SIGSTOPped DHT node."""

    def __init__(self) -> None:
        self.released = asyncio.Event()
        self.stored: list[tuple[str, bool]] = []

    async def declare_averager(self, group_key, peer_id, expiration_time, looking_for_group=True) -> bool:
        await self.released.wait()
        self.stored.append((group_key, looking_for_group))
        return True


def test_a_withdrawal_returns_at_once_and_is_still_stored_while_a_declaration_waits() -> None:
    async def run() -> None:
        keys = FrozenDHTKeys()
        detached = detach_withdrawals(keys)
        assert await asyncio.wait_for(detached("run.0b", "me", 10.0, looking_for_group=False), 1.0) is True
        declaring = asyncio.ensure_future(detached("run.0b", "me", 12.0))
        await asyncio.sleep(0.05)
        assert not declaring.done(), "a declaration must still wait for its store: it is what followers look up"
        keys.released.set()
        assert await declaring is True
        await asyncio.wait_for(asyncio.gather(*detached.pending), 1.0)
        assert sorted(keys.stored) == [("run.0b", False), ("run.0b", True)]
        assert not detached.pending

    asyncio.run(run())


def test_detaching_is_idempotent() -> None:
    keys = FrozenDHTKeys()
    original = keys.declare_averager
    first = detach_withdrawals(keys)
    assert isinstance(first, DetachedWithdrawals) and detach_withdrawals(keys) is first
    assert first._declare == original  # not wrapped twice


class GroupKeysOnLocalStorage:
    """hivemind's own `GroupKeyManager.declare_averager` over one DHT node's real storage (no network)."""

    def __init__(self) -> None:
        self.storage = DHTLocalStorage()
        self.dht = self

    async def store(self, key, subkey, value, expiration_time, return_future=True) -> bool:
        return self.storage.store(DHTID.generate(source=key), value, expiration_time, subkey=subkey)

    async def declare_averager(self, group_key, peer_id, expiration_time, looking_for_group=True) -> bool:
        return await GroupKeyManager.declare_averager(self, group_key, peer_id, expiration_time, looking_for_group)

    def looking(self, group_key: str, peer: PeerID) -> bool:
        entry = self.storage.get(DHTID.generate(source=group_key)).value.get(peer.to_bytes())
        return entry is not None and entry.value is True


def test_a_retried_search_is_visible_after_withdrawing_the_same_expiration() -> None:
    # hivemind retries a failed group's search within the step with the step's scheduled time, the expiration it
    # has just withdrawn: the DHT keeps the withdrawal (one ulp later) and no other island could find the retry.
    me = PeerID.from_base58("QmPZagA4xYtVQ8jfpx66LEsn3ZjRM4R6Z1g8sLUp7t6iXY")

    async def run(withdrawal_lands_first: bool) -> tuple[bool, bool]:
        plain, keys = GroupKeysOnLocalStorage(), GroupKeysOnLocalStorage()
        detached, expiration = detach_withdrawals(keys), get_dht_time() + 30.0
        await plain.declare_averager("run.0b", me, expiration)
        await detached("run.0b", me, expiration)
        await plain.declare_averager("run.0b", me, expiration, looking_for_group=False)
        await plain.declare_averager("run.0b", me, expiration)
        await detached("run.0b", me, expiration, looking_for_group=False)
        if withdrawal_lands_first:
            await asyncio.gather(*detached.pending)
        assert await detached("run.0b", me, expiration) is True
        await asyncio.gather(*detached.pending)
        return plain.looking("run.0b", me), keys.looking("run.0b", me)

    for order in (True, False):
        assert asyncio.run(run(order)) == (False, True), f"withdrawal stored first: {order}"
