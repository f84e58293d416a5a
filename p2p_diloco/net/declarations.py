"""Declarations the DHT accepts: each round's group-key declaration expires after this island's previous one.

hivemind declares an island under its group key with the round's scheduled time as the record's expiration, and a
DHT node keeps only the latest-expiring record of each (key, subkey): a store that expires no later than the one it
holds is refused, and so is hivemind's withdrawal, which reuses the declaration's expiration. Islands run rounds
back to back, and a round whose group filled at once leaves its declaration standing until its scheduled time; a
next round scheduled sooner (a shorter grace window, or another fragment's) is refused everywhere, nobody sees the
island looking, and its round finds no group. Measured in tests/test_decoupled_swarm.py: after a stall the two
fragments' adaptive windows drifted apart (3 s and 1.5 s) and every later round of the short one was lost on every
island. So a round is scheduled no sooner than just after the previous declaration expires.
"""

from __future__ import annotations

DECLARATION_GAP_S = 0.01
"""How much later than the previous declaration's expiration a new one expires (any positive amount is newer)."""


class DeclarationClock:
    """The latest expiration this island may have declared under its group key, and the next round's schedule."""

    def __init__(self) -> None:
        self.declared_until = float("-inf")

    def schedule(self, now: float, grace_s: float) -> float:
        """The scheduled time (DHT time) of a round starting `now` with a grace window of `grace_s`."""
        return max(now + grace_s, self.declared_until + DECLARATION_GAP_S)

    def ended(self, scheduled: float, now: float, min_matchmaking_time: float, deadline: float) -> None:
        """Note a round that ended `now`. hivemind declared it until `max(scheduled, t + min_matchmaking_time)` at a
        time t before now (and re-declares that way while it searches), never past the round's `deadline`."""
        until = max(scheduled, min(deadline, now + min_matchmaking_time))
        self.declared_until = max(self.declared_until, until)
