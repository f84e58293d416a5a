"""When an island re-announces itself, and how its view of the swarm stays current between announces.

An announce is a signed DHT store of the island's record plus a `get` of every island's record of the run; on a
5-node swarm that is about 50 KB per island and round (`benchmarks/bandwidth.py`, stop 19), more than a sparse
codec's whole payload. Between announces the island learns its partners' outer steps from the metadata the group
gathered in each round, which is what the group itself weighs contributions by.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any


class AnnounceSchedule:
    """Announce every `every` rounds, and never more than `max_interval_s` after the last announce."""

    def __init__(self, every: int, max_interval_s: float, clock: Callable[[], float] = time.monotonic):
        self.every, self.max_interval_s, self._clock = every, max_interval_s, clock
        self._rounds_since = 0
        self._last = float("-inf")

    def start(self, scheduled: bool) -> bool:
        """Whether to announce now: always when not `scheduled` (joining, leaving), else once the round is due.

        A scheduled call counts a round; an announce counts from now."""
        self._rounds_since += scheduled
        if scheduled and self._rounds_since < self.every and self._clock() - self._last < self.max_interval_s:
            return False
        self._rounds_since, self._last = 0, self._clock()
        return True


def fold_partner_steps(view: dict[str, dict[str, Any]], partners: Mapping[str, Mapping[str, Any]]) -> int:
    """Update the outer step of islands already in `view` from this round's partners' metadata; returns how many.

    Only a newer integer step is taken, and only for islands whose record was read: a partner's metadata is a claim
    like its record, and the swarm clock bounds both the same way (`SwarmClock.update`).
    """
    updated = 0
    for peer, metadata in partners.items():
        step, known = metadata.get("outer_step") if isinstance(metadata, Mapping) else None, view.get(peer)
        if known is None or not isinstance(step, int) or isinstance(step, bool):
            continue
        current = known.get("outer_step")
        if not isinstance(current, int) or step > current:
            view[peer] = {**known, "outer_step": step}  # an existing key: safe beside a reader in another thread
            updated += 1
    return updated
