"""A search for a group ends without waiting for its withdrawal from the DHT (a frozen DHT node answers late)."""

from __future__ import annotations

import asyncio

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
