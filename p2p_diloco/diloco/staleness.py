"""What an island does with a pseudo-gradient computed from an anchor older than the swarm's."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
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


WEIGHT_CAP = 2.0
"""No member's weight may exceed this multiple of the group's lower median weight (claims cannot buy a merge)."""


def agreeing(count: int) -> int:
    """K: how many distinct islands must have reached a step for it to count as the clock (1 of 1, 2 of 2-4, ...)."""
    return 1 if count <= 1 else 1 + math.ceil((count - 1) / 3)


def robust_clock(claims: Sequence[int]) -> int:
    """The K-th highest of the claimed steps: one island's claim never sets the clock for the others."""
    if not claims:
        return 0
    ordered = sorted(claims, reverse=True)
    return ordered[agreeing(len(ordered)) - 1]


def plausible_limit(view_step: int, view_age_s: float, round_s: float) -> int:
    """The highest step the swarm can have reached `view_age_s` after a view at `view_step`, if no island can finish
    a round faster than a quarter of `round_s`: a claim beyond it is impossible and ignored."""
    return view_step + 1 + int(max(0.0, view_age_s) / max(round_s / 4, 0.05))


def _claim(member: Mapping[str, Any]) -> int:
    return max(int(member["outer_step"]), int(member.get("swarm_step", member["outer_step"])))


def lower_median(values: Sequence[float]) -> float:
    """The median, rounding down to the smaller middle value (for two values: the smaller)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def group_weights(members: Mapping[K, Mapping[str, Any]], rule: StalenessRule) -> dict[K, float]:
    """The most each group member's contribution may weigh: its base weight, discounted by the staleness rule
    against the group's robust clock, capped at WEIGHT_CAP times the lower median base weight.

    Every member computes the same bounds from the same gathered metadata, and every reducer applies them to what
    senders declare, so a member cannot buy the merge by claiming a large weight or a far-ahead clock.
    """
    clock = robust_clock([_claim(m) for m in members.values()])
    bases = {key: max(0.0, float(m["base_weight"])) for key, m in members.items()}
    if not all(math.isfinite(base) for base in bases.values()):
        raise ValueError("a member declared a non-finite weight")
    cap = WEIGHT_CAP * lower_median(list(bases.values())) if len(bases) > 1 else math.inf
    weights = {}
    for key, member in members.items():
        factor = rule.factor(clock - int(member["outer_step"]))
        weights[key] = 0.0 if factor is None else min(bases[key], cap) * factor
    return weights


def weight_claims_over_cap(members: Mapping[K, Mapping[str, Any]]) -> dict[K, tuple[float, float]]:
    """Members whose declared base weight exceeds the group's cap (`group_weights`): key -> (claimed, cap)."""
    bases = {key: max(0.0, float(m["base_weight"])) for key, m in members.items()}
    if len(bases) < 2:
        return {}
    cap = WEIGHT_CAP * lower_median(list(bases.values()))
    return {key: (base, cap) for key, base in bases.items() if base > cap}


def own_weight(me: K, members: Mapping[K, Mapping[str, Any]], rule: StalenessRule, now: float) -> float:
    """This member's own weight: its bound from `group_weights`, or 0 when a partner's plausible claim shows that
    the swarm moved on while this member's view was stale (e.g. it was frozen in matchmaking).

    `now` is the DHT time; a member's view dates from its `ready` time, and it finishes rounds in about `round_s`.
    """
    mine = members[me]
    if rule.factor(own_clock(me, members, now) - int(mine["outer_step"])) is None:
        return 0.0
    return group_weights(members, rule)[me]


def stale_partners(
    me: K, members: Mapping[K, Mapping[str, Any]], weights: Mapping[K, float], rule: StalenessRule
) -> dict[K, int]:
    """Members the group weighed (`weights`, from `group_weights`) although this member's own step shows them too
    stale: key -> steps behind.

    The group's clock is the K-th highest claim, so in a group of two it is the lower one, and an island woken from
    a freeze, its view too young to doubt its partner's lead, merges at full weight. Its partner knows its own step
    for certain (a member can only make itself look older, never another), and discards such a round.
    """
    mine = int(members[me]["outer_step"])
    behind = {key: mine - int(member["outer_step"]) for key, member in members.items() if key != me}
    return {key: lag for key, lag in behind.items() if weights[key] > 0 and rule.factor(lag) is None}


def own_clock(me: K, members: Mapping[K, Mapping[str, Any]], now: float) -> int:
    """The newest step a member can believe the group has reached: its own view, or any partner's plausible claim."""
    limit = claim_limit(members[me], now)
    return max([_claim(members[me])] + [c for c in map(_claim, members.values()) if c <= limit])


def claim_limit(mine: Mapping[str, Any], now: float) -> int:
    """The highest step a partner can honestly claim, judged from this member's own view and its age."""
    age = now - float(mine.get("ready", now))
    return plausible_limit(_claim(mine), age, float(mine.get("round_s", 1.0)))


def implausible_claims(me: K, members: Mapping[K, Mapping[str, Any]], now: float) -> dict[K, int]:
    """Partners whose claimed step is beyond what the swarm can have reached by this member's view: key -> claim.

    A member that has seen no step yet (it started fresh and found no records) cannot tell an honest lead from a
    lie: `own_clock` ignores such claims all the same, but naming the partners as liars would blame an honest swarm.
    """
    if _claim(members[me]) == 0:
        return {}
    limit = claim_limit(members[me], now)
    return {key: _claim(member) for key, member in members.items() if _claim(member) > limit}


def claimed_step(member: Mapping[str, Any]) -> int:
    """The newest step a member says it knows of (its own or the swarm's)."""
    return _claim(member)


PACE_ROUNDS = 8
"""Rounds whose shortest duration sets the pace of `SwarmClock`'s bound. The last round alone is not enough: an
island frozen (SIGSTOP, a suspended laptop) during its inner steps measured a round as long as the freeze, judged
the swarm that ran on meanwhile 4x slower than it was, and refused its honest donors for 9 s (11 rounds trained
alone and thrown away)."""


class SwarmClock:
    """An island's estimate of the swarm's clock from the run's records.

    Its own step, or the robust clock (K-th highest) of the other islands' claims, whichever is newer; once a clock
    is known, claims beyond what the swarm can have reached since (`plausible_limit`) are ignored. "Since" counts
    from the last update that brought news of the swarm (the robust clock of the claims rose, or reached this
    island's step), not from the last look: an island woken after a freeze whose first look read records as old
    as itself took that look for a fresh view, and for good refused the swarm 7 steps ahead as impossible, each
    later look allowing only a round's worth of steps past the last (test_decoupled_swarm).
    """

    def __init__(self) -> None:
        self.value: int | None = None
        self.time = 0.0
        self.implausible: dict[Any, int] = {}
        """Claims the last update ignored or outvoted as impossible, by who made them."""
        self._recent_rounds: deque[float] = deque(maxlen=PACE_ROUNDS)
        self._view: int | None = None
        """The robust clock of the claims the last news brought."""
        self.heard_from_swarm = False
        """Whether any other island's claim reached this clock. Until one did, the clock is only this island's step
        and bounds nothing: a newcomer that joined while the DHT looked empty (a bootstrap that had just restarted)
        took its own step 0 for the swarm's and refused every honest island at step 51 as impossible, for good."""

    @property
    def pace_s(self) -> float | None:
        """This island's shortest recent round: the pace the plausibility bound assumes (None before a round)."""
        return min(self._recent_rounds) if self._recent_rounds else None

    def update(self, own: int, others: Mapping[Any, int], now: float, round_s: float) -> int:
        """Fold in this island's step and the steps the other live islands claim; returns the clock."""
        claims = dict(others)
        self._recent_rounds.append(round_s)
        if self.heard_from_swarm:  # then a value is set
            limit = plausible_limit(self.value, now - self.time, self.pace_s)
            claims = {who: claim for who, claim in claims.items() if claim <= limit}
        view = robust_clock(list(claims.values())) if claims else None
        if view is not None and (self._view is None or view > self._view or view >= own):
            self.time, self._view = now, view
        self.value = max(own, view or 0)
        self.heard_from_swarm = self.heard_from_swarm or bool(claims)
        far = 2 * self.value + 10  # beyond any honest lead: name it even when the robust clock outvoted it
        self.implausible = {who: claim for who, claim in others.items() if who not in claims or claim > far}
        return self.value
