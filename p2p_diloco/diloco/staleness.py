"""What an island does with a pseudo-gradient computed from an anchor older than the swarm's."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

K = TypeVar("K")


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


def group_weights(members: Mapping[K, Mapping[str, Any]], rule: StalenessRule) -> dict[K, float]:
    """Each group member's merge weight: its base weight times the rule's factor against the group's clock.

    The clock is the newest outer step any member knows of (its own or the swarm's, read from the DHT), so a
    member that slept through several rounds and joins a newer group is discounted or rejected (weight 0) by
    everyone alike, even when its own view of the swarm was stale. Every member computes the same weights from
    the same gathered metadata, which keeps the merge bit-identical across the group.
    """
    clock = max(max(int(m["outer_step"]), int(m.get("swarm_step", m["outer_step"]))) for m in members.values())
    weights = {}
    for key, member in members.items():
        factor = rule.factor(clock - int(member["outer_step"]))
        weights[key] = 0.0 if factor is None else float(member["base_weight"]) * factor
    return weights
