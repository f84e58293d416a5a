"""Matchmaking that ends without waiting for its withdrawal from the DHT, and retries that others can find.

When an island's search for a group ends, hivemind's `PotentialLeaders.begin_search` cancels its declaration task
and waits for it, and that task's `finally` stores a withdrawal (the island no longer looks for a group) in the
DHT and awaits the store. A store waits for every DHT node that holds the group key, and one that is frozen
(SIGSTOP, a suspended VM, a closed laptop lid) answers only after the DHT's wait_timeout per request: measured in
benchmarks/chaos.py, each freeze of one island held every other island's search open for the whole 8 s freeze and
their round failed ("could not find a group", 7.6 s instead of 0.4 s). A withdrawal only saves a would-be
follower one refused request until the declaration expires a moment later, so it is sent and not awaited.

A search that hivemind retries within the same step (its group failed: a member was killed mid-round) declares
again with the step's scheduled time, the very expiration it just withdrew, while hivemind stores a withdrawal one
ulp later (`GroupKeyManager.declare_averager`) and the DHT keeps a subkey's value with the later expiration only.
The retry was invisible as a leader: when every member of a failed group retried, none found another and all lost
the round after the whole window (CI, tests/test_expected_group.py: both survivors of a kill searched 4 s and
found no group). A declaration that follows a withdrawal of the same key, at or before its expiration, is
therefore declared one ulp after it: a quarter of a microsecond later, the same deadline to every follower.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from hivemind.utils import get_logger

logger = get_logger(__name__)


class DetachedWithdrawals:
    """`GroupKeyManager.declare_averager` of one averager, with withdrawals sent in the background."""

    def __init__(self, key_manager: Any):
        self._declare = key_manager.declare_averager
        self.pending: set[asyncio.Task] = set()
        self._withdrawn: tuple[str, float] | None = None
        """The group key and expiration of the latest withdrawal (the ulp after it is what the DHT holds)."""

    async def __call__(
        self, group_key: str, peer_id: Any, expiration_time: float, looking_for_group: bool = True
    ) -> bool:
        """Declare as hivemind does; a withdrawal (looking_for_group=False) returns at once, its store goes on."""
        if looking_for_group:
            return await self._declare(group_key, peer_id, self._after_withdrawal(group_key, expiration_time))
        self._withdrawn = (group_key, float(np.nextafter(expiration_time, np.inf)))
        declaring = self._declare(group_key, peer_id, expiration_time, looking_for_group)
        task = asyncio.ensure_future(declaring)
        self.pending.add(task)
        task.add_done_callback(self._finished)
        return True

    def _after_withdrawal(self, group_key: str, expiration_time: float) -> float:
        """`expiration_time`, or the ulp after this key's withdrawal where that is later (the DHT keeps the later)."""
        if self._withdrawn is None or self._withdrawn[0] != group_key or expiration_time > self._withdrawn[1]:
            return expiration_time
        return float(np.nextafter(self._withdrawn[1], np.inf))

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
