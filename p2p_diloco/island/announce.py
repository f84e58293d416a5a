"""When an island re-announces itself, and how its view of the swarm stays current between announces.

An announce is a signed DHT store of the island's record plus a `get` of every island's record of the run; on a
5-node swarm that is about 50 KB per island and round (`benchmarks/bandwidth.py`, stop 19), more than a sparse
codec's whole payload. Between announces the island learns its partners' outer steps from the metadata the group
gathered in each round, which is what the group itself weighs contributions by; when the group finds it too
stale, it reads the records at once, so that its catch-up knows where the swarm is now.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)


class AnnounceSchedule:
    """Announce every `every` rounds, and never more than `max_interval_s` after the last announce."""

    def __init__(self, every: int, max_interval_s: float, clock: Callable[[], float] = time.monotonic):
        self.every, self.max_interval_s, self._clock = every, max_interval_s, clock
        self._rounds_since = 0
        self._last = float("-inf")

    def hurry(self) -> None:
        """Make the next scheduled announce come at once: after a round without partners the view may be stale
        (islands that joined since, a relayed island to dial), and the chatter saved is no longer worth it."""
        self._rounds_since = self.every

    @property
    def fresh(self) -> bool:
        """True when no scheduled round has passed since the last announce: the view is this round's."""
        return self._rounds_since == 0 and self._last > float("-inf")

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


def timed_pace_s(history: Any) -> float | None:
    """The median time between a record's recent rounds (`Progress.history`: time last); None when they do not
    time two rounds (or are malformed: a liar's)."""
    try:
        times = sorted(float(entry[-1]) for entry in history)
        gaps = [later - earlier for earlier, later in zip(times, times[1:]) if later > earlier]
    except (TypeError, ValueError, IndexError):
        return None
    pace = statistics.median(gaps) if gaps else None
    return pace if pace is not None and math.isfinite(pace) else None


class SwarmViewMixin:
    """Island's side of the run's records: its announcement, the (scheduled) announce, and the swarm clock."""

    def _announcement(self, leaving: bool = False) -> dict[str, Any]:
        """This island's record in the run (bounded: a few hundred bytes plus a short history)."""
        identity = {"fingerprint": self.fingerprint, "codec": self.config.network.codec}
        record = self.progress.announcement(identity, self.outer_step, self.trainer, self.link.reachability)
        return {**record, "leaving": leaving}

    def _announce(self, *, scheduled: bool = False, leaving: bool = False) -> dict[str, dict[str, Any]]:
        """Tell the run where we are (a `scheduled` one only when due, `leaving` as the island's last); returns and
        keeps the others' records."""
        if not self.announces.start(scheduled):
            return self.swarm_view
        try:
            self.swarm_view = self.link.records.announce(self._announcement(leaving), check=False)
            self.link.refresh(self.swarm_view)
        except Exception as error:  # a slow or restarting DHT must not stop training: use the last view
            logger.warning(f"could not reach the DHT to announce this island ({error!r}); using the last view")
        return self.swarm_view

    exchanged_once = False
    """Whether this process's island has exchanged yet (its first exchange waits longer: `_round_grace`)."""

    def _round_grace(self, grace_s: float) -> float:
        """The grace window of this round's exchange: `grace_s`, but for the island's first exchange since it
        started at least a round of the swarm's (the median pace of the records that time two rounds; at most
        averaging_timeout).

        A newcomer that misses its partners' matchmaking steps alone, off the swarm's lineage, and falls back on
        resyncs. Trained during its state download, a 38M newcomer's first round was ready seconds before its
        partner, whose rounds took 15 s, finished its inner steps: its 2 s window ran out first
        (benchmarks/restart_link.py). Only the first: partners that died leave records that keep their pace until
        they expire. A swarm's first rounds have no paced records and keep the window."""
        if self.exchanged_once:
            return grace_s
        self.exchanged_once = True
        others = [info for peer, info in self.swarm_view.items() if peer != self.peer_id and not info.get("leaving")]
        known = [pace for pace in map(timed_pace_s, (info.get("history") for info in others)) if pace is not None]
        if not known:
            return grace_s
        return max(grace_s, min(statistics.median(known), self.config.network.averaging_timeout))

    def _update_clock(self, round_s: float) -> int:
        """Fold this island's step and the swarm view's into the swarm clock, naming impossible claims; the clock."""
        # An island that left and had no state to give at our last catch-up (`departed`) no longer sets the clock:
        # one woken after the swarm finished would otherwise stay too stale for good, alone.
        view = self.swarm_view.items()
        others = {p: int(info["outer_step"]) for p, info in view if not (info.get("leaving") and p in self.departed)}
        swarm_step = self.clock.update(self.outer_step, others, get_dht_time(), round_s)
        for peer, claim in self.clock.implausible.items():
            self.progress.warn_once(peer, f"claims outer step {claim}, which the swarm cannot have reached: ignored")
        return swarm_step
