"""The grace window: how long an island that has its quorum waits for more partners before merging."""

from __future__ import annotations

from collections import deque
from typing import Any

GRACE_MODES = ("adaptive", "fixed")


class GraceWindow:
    """Adaptive (default) or fixed; always bounded by [min_s, max_s].

    Adaptive: the window covers the 90th percentile of how much later than this island its partners arrived in
    recent rounds (plus a small margin), but never more than `gamma` times the island's own round of compute,
    plus any overlap slack: waiting longer than that would cost more compute than a late partner brings.
    When a round finds no partner although other islands are alive, matchmaking itself is slower than the
    window (a loaded machine, a slow link): the window doubles, up to max_s, and halves back after a merge.
    """

    def __init__(
        self,
        *,
        mode: str = "adaptive",
        initial_s: float = 2.0,
        min_s: float = 0.5,
        max_s: float = 10.0,
        gamma: float = 0.5,
        margin_s: float = 0.25,
        history: int = 32,
    ):
        if mode not in GRACE_MODES:
            raise ValueError(f"grace mode must be 'adaptive' or 'fixed', got {mode!r}")
        self.mode, self.initial_s, self.min_s, self.max_s = mode, initial_s, min_s, max_s
        self.gamma, self.margin_s = gamma, margin_s
        self.delays: deque[float] = deque(maxlen=history)
        self.compute_s: float | None = None
        self.backoff = 1.0

    @classmethod
    def for_network(cls, network: Any) -> GraceWindow:
        """The window a NetworkConfig describes (grace, grace_s, grace_max_s, grace_gamma; min_matchmaking_time)."""
        return cls(
            mode=network.grace,
            initial_s=network.grace_s,
            min_s=network.min_matchmaking_time,
            max_s=network.grace_max_s,
            gamma=network.grace_gamma,
        )

    def observe(self, partner_delays: list[float], compute_s: float, missed: bool = False) -> None:
        """Record the partners' lateness, our compute time, and whether we missed partners that were alive."""
        self.delays.extend(max(0.0, delay) for delay in partner_delays)
        self.compute_s = compute_s
        if missed:
            self.backoff = min(self.backoff * 2.0, self.max_s / max(self.min_s, 1e-6))
        elif partner_delays:
            self.backoff = max(1.0, self.backoff / 2.0)

    def current(self, slack_s: float = 0.0) -> float:
        """The window for the next round, in seconds."""
        if self.mode == "fixed":
            return min(self.max_s, max(self.min_s, self.initial_s))
        if not self.delays or self.compute_s is None:
            window = self.initial_s
        else:
            ordered = sorted(self.delays)
            window = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] + self.margin_s
            window = min(window, self.gamma * self.compute_s + slack_s)
        return min(self.max_s, max(self.min_s * self.backoff, window))
