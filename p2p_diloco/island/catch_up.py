"""An island too stale to merge: drop its contribution and download the swarm's state, or step alone without donors."""

from __future__ import annotations

import time
from typing import Any

from p2p_diloco.island.checkpoints import donor_step_limit
from p2p_diloco.island.resync import CatchUpStatus
from p2p_diloco.island.rounds import Landed, RoundOutcome, Verdict
from p2p_diloco.net.exchange import ExchangeResult


class CatchUpMixin:
    """Island's catch-up when the swarm (its own view, or the group's verdict) finds it too far behind."""

    def _catch_up(self, staleness: int, swarm_step: int, contribution: Any) -> Landed:
        """A contribution too stale to send: catch up instead of exchanging."""
        start = time.monotonic()
        outcome = self._reject_stale(staleness, contribution)
        waited = time.monotonic() - start
        verdict = Verdict(ExchangeResult(merged=None, wait_s=waited), None, merged=False)
        return Landed(verdict, outcome, contribution.fragment.label, waited, waited, staleness, swarm_step)

    def _reject_stale(self, staleness: int, contribution: Any) -> RoundOutcome:
        """Drop a too-stale contribution and download the swarm's state; with no newer donor, apply it alone."""
        if self.error_feedback is not None:
            for feedback in self.error_feedback.values():
                feedback.clear()
        if self.link.online and not self.announces.fresh:  # where the swarm is now: the donors are there
            self._announce()
            self._update_clock(float(contribution.metadata.get("round_s") or 1.0))
        # Records lag their islands by up to announce_every rounds: a bound at the clock itself turned every honest
        # donor away from an island woken after a freeze while the swarm ran ahead (test_decoupled_swarm).
        clock = [] if self.clock.value is None else [self.clock.value]
        caught = self.resync.catch_up(max_step=donor_step_limit(clock, self.config.network.announce_every))
        if caught.status is CatchUpStatus.ADOPTED:
            self.trainer.load_all(self.state.anchor)
            note = f"{staleness} steps stale: contribution rejected, resynced to outer step {caught.outer_step}"
            return RoundOutcome(0, False, True, note)
        # The islands that announced they were leaving had nothing to give either: the clock stops counting them.
        self.departed = {peer for peer, info in self.swarm_view.items() if info.get("leaving")}
        self.state.step(contribution.delta, contribution.fragment)
        self.trainer.load(self.state.anchor, contribution.fragment, mix_alpha=None)
        return RoundOutcome(0, False, False, f"{staleness} steps stale and no newer donor answered")
