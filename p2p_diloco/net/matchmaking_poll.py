"""A paced leader search: hivemind's matchmaking polls the DHT for group leaders back to back while it waits.

`PotentialLeaders.pop_next_leader` asks for a fresh look-up whenever its queue is empty (or its best leader is
not yet assured), and `_update_queue_periodically` answers each request with a `get` of the group key at once,
so an island that waits for its group repeats one DHT look-up per round trip: about 58 KB/s of chatter per
waiting island in `benchmarks/bandwidth.py` (stop 18's `chatter_fit`), more than a sparse codec's payload.
Spacing the look-ups bounds that: the gap starts at FIRST_GAP_S and doubles up to `interval`, so a group that
forms at once (every island ready together, as on a fast link) is found as quickly as before, and an island that
waits seconds for a slow partner looks up about 1/`interval` times a second.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from hivemind.averaging.key_manager import GroupKeyManager

DEFAULT_POLL_S = 0.25
"""Longest gap, in seconds, between two look-ups of the group key while an island waits for its group."""
FIRST_GAP_S = 0.02
"""The first gap of a search; each look-up doubles the next gap, up to the interval."""


class PacedLookups:
    """`get_averagers` of one GroupKeyManager with growing gaps between look-ups (`restart` at each new search)."""

    def __init__(self, key_manager: GroupKeyManager, interval: float):
        self.interval = interval
        self.lookups = 0
        self._lookup = key_manager.get_averagers
        self.restart()

    def restart(self) -> None:
        """A new search: the next look-up goes at once, the following ones FIRST_GAP_S, then twice as long..."""
        self._last, self._gap = float("-inf"), min(FIRST_GAP_S, self.interval)

    async def __call__(self, group_key: str, only_active: bool) -> list[tuple[Any, float]]:
        """The averagers declared under `group_key`, no sooner than the current gap after the previous look-up."""
        wait = self._last + self._gap - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        if self._last > float("-inf"):
            self._gap = min(2 * self._gap, self.interval)
        self._last = time.monotonic()
        self.lookups += 1
        return await self._lookup(group_key, only_active)


def pace_lookups(key_manager: GroupKeyManager, interval: float) -> PacedLookups | None:
    """Pace `key_manager`'s look-ups of group leaders up to `interval` apart from now on, a new search starting
    (0 keeps hivemind's back-to-back pace)."""
    if interval <= 0:
        return None
    if isinstance(key_manager.get_averagers, PacedLookups):
        key_manager.get_averagers.interval = interval
        key_manager.get_averagers.restart()
        return key_manager.get_averagers
    # An instance attribute, not a subclass: hivemind builds its GroupKeyManager inside Matchmaking.__init__,
    # in the averager's own process, and offers no hook to pass another class.
    paced = PacedLookups(key_manager, interval)
    key_manager.get_averagers = paced
    return paced
