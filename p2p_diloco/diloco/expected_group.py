"""Which islands a round can still expect, so that a group starts as soon as all of them have joined.

hivemind's leader waits out its whole matchmaking window unless the group reaches its target size, and the target
is a fixed cap (8 by default). With fewer islands alive the window is always waited out in full: measured in
benchmarks/chaos.py, rounds with one of five islands down waited 1.1 s for a partner that was dead, against
0.4 s with all five. An island expects every other island it merged with in its last few rounds, and any island
that announced itself after it last merged with it (a newcomer, a restarted or woken island: islands read records
only every few rounds, so the announce is compared with the last merge, not with a window of rounds that could
pass before the record is read) for as many rounds from when this island read that announce; an island missing from
that many rounds and silent since is no longer waited for. (Counted from the merge alone, an island killed just after
its announce was waited for in every round until its record expired: tests/test_expected_group.py.) A recent partner
that is no longer connected is not waited for either: a killed island's connections close with its p2pd (measured
in benchmarks/chaos.py, its partners waited out the window for it for 3 rounds after each kill). An island that
finishes or stops announces itself `leaving`, and is not waited for from the round its record is read: without it,
its last announce was read as a newcomer's and its partners waited the whole window for it for 6 rounds.
Records carry the announcer's wall clock: a clock that runs ahead only makes us wait the window, as without this.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any


class ExpectedPartners:
    """Counts the islands to wait for in the next round from the recent rounds' partners and the announced records."""

    def __init__(self, memory_rounds: int = 3) -> None:
        self.memory_rounds = memory_rounds
        self.rounds = 0
        self.last_seen: dict[str, tuple[int, float]] = {}
        """Per island: the round (counted here) and the wall-clock time it was last in a group with this island."""
        self.announce_read: dict[str, tuple[float, int]] = {}
        """Per island: its newest announce time read here, and the round (counted here) when it was first read."""
        self.partners: set[str] = set()
        """The other islands the latest `expected` counted (every other island in view when it could not tell)."""

    def observe(self, partners: Iterable[str], ended_at: float) -> list[str]:
        """Record one finished round: who was in the group, and when it ended (wall-clock seconds); the islands
        still expected that were not in it (worth asking whether they are alive, see `expected`'s `connected`)."""
        self.rounds += 1
        partners = set(partners)
        for peer in partners:
            self.last_seen[peer] = (self.rounds, ended_at)
        recent = (peer for peer, (seen, _) in self.last_seen.items() if self.rounds - seen < self.memory_rounds)
        return sorted(peer for peer in recent if peer not in partners)

    def expected(
        self, view: Mapping[str, Mapping[str, Any]], own_peer: str, connected: set[str] | None = None
    ) -> int | None:
        """The group size to start at once (this island included), or None to wait out the window as before.

        `connected`: the peers this island holds a connection to (None: unknown). A recent partner no longer
        connected is not waited for: a process that died took its connections with it. The island leaves out of
        it, too, a recent partner that missed a round and answers no ping since: a frozen process keeps its
        connections open."""
        self.partners = {peer for peer in view if peer != own_peer}
        if self.memory_rounds <= 0 or self.rounds < self.memory_rounds:
            return None  # too few rounds to tell who stopped coming
        counted = set()
        for peer, record in view.items():
            if peer == own_peer:
                continue
            seen_round, seen_at = self.last_seen.get(peer, (None, -math.inf))
            announced = record.get("time") if isinstance(record, Mapping) else None
            leaving = isinstance(record, Mapping) and record.get("leaving") is True
            if leaving and _number(announced) and announced >= seen_at:
                continue  # it announced its last round and has not been in a group since (a restart would have)
            recent = seen_round is not None and self.rounds - seen_round < self.memory_rounds
            recent = recent and (connected is None or peer in connected)
            announced_since = _number(announced) and announced > seen_at
            if recent or (announced_since and self.rounds - self._read_at(peer, announced) < self.memory_rounds):
                counted.add(peer)
        self.partners = counted
        return 1 + len(counted)

    def _read_at(self, peer: str, announced: float) -> int:
        """The round in which this island first read `peer`'s announce at time `announced`."""
        known = self.announce_read.get(peer)
        if known is None or known[0] != announced:
            self.announce_read[peer] = known = (announced, self.rounds)
        return known[1]


def group_target(expected: int | None, quorum: int, cap: int) -> int:
    """The target size for hivemind's matchmaking: the expected group, never below a pair or the quorum, nor above
    the configured cap (a target of one would turn every joiner away)."""
    if expected is None:
        return cap
    return min(cap, max(2, quorum, expected))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
