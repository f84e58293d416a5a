"""Matchmaking that ends without waiting for its withdrawal from the DHT.

When an island's search for a group ends, hivemind's `PotentialLeaders.begin_search` cancels its declaration task
and waits for it, and that task's `finally` stores a withdrawal (the island no longer looks for a group) in the
DHT and awaits the store. A store waits for every DHT node that holds the group key, and one that is frozen
(SIGSTOP, a suspended VM, a closed laptop lid) answers only after the DHT's wait_timeout per request: measured in
benchmarks/chaos.py, each freeze of one island held every other island's search open for the whole 8 s freeze and
their round failed ("could not find a group", 7.6 s instead of 0.4 s). A withdrawal only saves a would-be
follower one refused request until the declaration expires a moment later, so it is sent and not awaited.
"""

from __future__ import annotations

import asyncio
from typing import Any

from hivemind.utils import get_logger

logger = get_logger(__name__)


class DetachedWithdrawals:
    """`GroupKeyManager.declare_averager` of one averager, with withdrawals sent in the background."""

    def __init__(self, key_manager: Any):
        self._declare = key_manager.declare_averager
        self.pending: set[asyncio.Task] = set()

    async def __call__(
        self, group_key: str, peer_id: Any, expiration_time: float, looking_for_group: bool = True
    ) -> bool:
        """Declare as hivemind does; a withdrawal (looking_for_group=False) returns at once, its store goes on."""
        declaring = self._declare(group_key, peer_id, expiration_time, looking_for_group)
        if looking_for_group:
            return await declaring
        task = asyncio.ensure_future(declaring)
        self.pending.add(task)
        task.add_done_callback(self._finished)
        return True

    def _finished(self, task: asyncio.Task) -> None:
        self.pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug(f"withdrawing from a group key failed: {task.exception()!r}")


def detach_withdrawals(key_manager: Any) -> DetachedWithdrawals:
    """Send `key_manager`'s withdrawals without waiting for them from now on (idempotent)."""
    if isinstance(key_manager.declare_averager, DetachedWithdrawals):
        return key_manager.declare_averager
    # An instance attribute, not a subclass: hivemind builds its GroupKeyManager inside Matchmaking.__init__, in the
    # averager's own process, and offers no hook to pass another class (as for net/matchmaking_poll.py).
    detached = DetachedWithdrawals(key_manager)
    key_manager.declare_averager = detached
    return detached
