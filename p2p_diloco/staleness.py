"""What an island does with a pseudo-gradient computed from an anchor older than the swarm's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StalenessRule:
    """A contribution `s` outer steps behind the swarm is weighted by discount**s, or rejected past max_staleness.

    The island applies the rule to its own contribution before sending it (it knows the swarm's clock from the
    DHT), so no partner ever averages in a rejected pseudo-gradient; a rejected island downloads the swarm's
    state instead, as a restarted learner does.
    """

    max_staleness: int = 4
    discount: float = 0.5

    def factor(self, staleness: int) -> float | None:
        """Weight multiplier for a contribution `staleness` steps old; None when it must be rejected."""
        if staleness <= 0:
            return 1.0
        if staleness > self.max_staleness:
            return None
        return self.discount**staleness
