"""The goodput simulator's p2p-diloco: M islands, quorum K = 1 merges on a global grid, with the real merge
weights and staleness rule of p2p_diloco.diloco (see benchmarks/simulator.py for the model)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from lib.simulation import (
    BOUNDARY,
    FAIL,
    PULLED,
    RECOVERY,
    RESTART,
    EventQueue,
    Params,
    checkpointed,
    rng_for,
    time_to_next,
)
from p2p_diloco.diloco.merge import MERGE_RULES, contribution_weight, weighted_mean
from p2p_diloco.diloco.staleness import StalenessRule


@dataclass
class _Island:
    up: bool = True
    pulling: bool = False
    seg_start: float = 0.0  # training (re)started here; the checkpoint grid starts here too
    banked_s: float = 0.0  # training since the last contribution that is safe in a checkpoint, before seg_start
    anchor: int = 0  # the merge this island's parameters descend from
    sent: list = field(default_factory=list)  # (steps, anchor): pseudo-gradients sent on recovery, merged next


class P2PSimulation:
    """One run of M islands on the virtual clock; `run()` returns its row."""

    def __init__(self, chips: int, islands: int, p: Params, seed: int = 0):
        if p.merge not in MERGE_RULES:
            raise ValueError(f"merge rule must be one of {MERGE_RULES}, got {p.merge!r}")
        if p.recovery not in RECOVERY:
            raise ValueError(f"recovery must be one of {RECOVERY}, got {p.recovery!r}")
        self.chips, self.islands, self.p = chips, islands, p
        self.rng = rng_for(seed, "p2p_diloco", chips, islands)
        self.rule = StalenessRule(max_staleness=p.max_staleness, discount=p.discount)
        self.size = chips / islands
        self.rate, self.end, self.stall = self.size * p.chip_rate, p.duration_s, p.sync_stall_s(islands)
        self.queue = EventQueue()
        self.state = [_Island() for _ in range(islands)]
        for index in range(islands):
            self.queue.push(time_to_next(self.rng, self.rate), FAIL, index)
        self.queue.push(p.round_s, BOUNDARY)
        self.merges = 0
        self.useful = self.accepted = 0.0  # tokens, in chip-steps
        self.counts = {"failures": 0, "contributions": 0, "stale_contributions": 0, "rejected": 0, "pulls": 0}
        self.lost_s = self.rejected_s = self.stall_s = 0.0
        self.merged_steps: list[float] = []

    def run(self) -> dict:
        """Every event until the end of the run, then a last outer step."""
        while self.queue.next_time() < self.end:
            now, kind, who = self.queue.pop()
            if kind == BOUNDARY:
                self.contribute(now, final=False)
                # a healthy island's cadence: H steps, then its stall
                self.queue.push(now + self.p.round_s + self.stall, BOUNDARY)
            elif kind == FAIL:
                self.fail(now, who)
            elif kind == RESTART:
                self.restart(now, who)
            else:  # PULLED: the swarm's current state, a fresh anchor
                island = self.state[who]
                island.pulling, island.anchor, island.seg_start = False, self.merges, now
                self.queue.push(now + time_to_next(self.rng, self.rate), FAIL, who)
        self.contribute(self.end, final=True)
        return self.row()

    def contribute(self, now: float, *, final: bool) -> None:
        """An outer step at `now`: every island with un-contributed work sends it; all up islands adopt the merge."""
        deltas, weights = [], []
        for island in self.state:
            for steps, anchor in self._pending(island, now, final):
                accepted = self._accept(steps, anchor) if steps > 0 else None
                if accepted is not None:
                    deltas.append(steps)
                    weights.append(accepted)
        if not deltas:
            return
        if sum(weights) > 0:
            # Each pseudo-gradient is summarised by its length in inner steps (one-element views of one tensor).
            self.merged_steps.append(float(weighted_mean(torch.tensor(deltas, dtype=torch.float64).unbind(), weights)))
        self.merges += 1
        for island in self.state:
            if island.up and not island.pulling:
                contributed = now > island.seg_start or island.banked_s > 0
                island.anchor, island.banked_s = self.merges, 0.0
                if contributed and self.stall > 0:
                    island.seg_start = now + self.stall
                    self.stall_s += self.stall
                else:
                    island.seg_start = max(island.seg_start, now)

    def _pending(self, island: _Island, now: float, final: bool) -> list[tuple[float, int]]:
        """(steps, anchor) of what `island` sends at this outer step; clears what it sent on recovery."""
        pending = island.sent
        island.sent = []
        if island.up and not island.pulling:
            pending.append(((island.banked_s + max(0.0, now - island.seg_start)) / self.p.step_s, island.anchor))
        elif final and not island.up:
            pending.append((island.banked_s / self.p.step_s, island.anchor))  # what it would send once restarted
        return pending

    def _accept(self, steps: float, anchor: int) -> float | None:
        """Count one contribution; its merge weight, or None when the staleness rule rejects it."""
        factor = self.rule.factor(self.merges - anchor)
        if factor is None:
            self.counts["rejected"] += 1
            self.rejected_s += steps * self.p.step_s
            return None
        tokens = steps * self.size
        self.counts["contributions"] += 1
        self.counts["stale_contributions"] += factor < 1.0
        self.useful += tokens * factor
        self.accepted += tokens
        return contribution_weight(self.p.merge, tokens, steps) * factor

    def fail(self, now: float, who: int) -> None:
        """An island goes down: what its checkpoint holds is banked, the rest is lost."""
        island = self.state[who]
        self.counts["failures"] += 1
        trained = max(0.0, now - island.seg_start)
        kept = checkpointed(trained, self.p.ckpt_interval_s)
        island.banked_s += kept
        self.lost_s += trained - kept
        island.up = False
        self.queue.push(now + self.p.island_restart, RESTART, who)

    def restart(self, now: float, who: int) -> None:
        """An island comes back: it pulls the swarm's state, or resumes its own checkpoint."""
        island = self.state[who]
        island.up = True
        peer = any(other.up and not other.pulling for other in self.state if other is not island)
        if self.p.recovery == "pull" and peer:
            # Send the checkpointed pseudo-gradient (judged by the staleness rule when merged), then start
            # over from the swarm's current state.
            if island.banked_s > 0:
                island.sent.append((island.banked_s / self.p.step_s, island.anchor))
            pull = True
        else:
            # Resume from the island's own checkpoint (also what "pull" does with no healthy peer to pull
            # from, e.g. M = 1) unless the rule would reject its next contribution.
            pull = self.rule.factor(self.merges - island.anchor) is None
            if pull:
                self.counts["rejected"] += 1
                self.rejected_s += island.banked_s
        if pull:
            self.counts["pulls"] += 1
            island.banked_s, island.pulling = 0.0, True
            self.queue.push(now + self.p.pull_s, PULLED, who)
        else:
            island.seg_start = now
            self.queue.push(now + time_to_next(self.rng, self.rate), FAIL, who)

    def row(self) -> dict:
        """The run's row of the table."""
        ideal = self.chips * self.end / self.p.step_s
        islands, end = self.islands, self.end
        return {
            "chips": self.chips,
            "method": "p2p_diloco",
            "islands": islands,
            "goodput": self.useful / ideal,
            "goodput_undiscounted": self.accepted / ideal,
            **self.counts,
            "merges": self.merges,
            "merged_inner_steps": float(np.mean(self.merged_steps)) if self.merged_steps else 0.0,
            "lost_work_fraction": self.lost_s / (islands * end),
            "rejected_work_fraction": self.rejected_s / (islands * end),
            "sync_s": self.p.sync_s(islands),
            "sync_stall_fraction": self.stall_s / (islands * end),
        }


def simulate_p2p(chips: int, islands: int, p: Params, seed: int = 0) -> dict:
    """M independent islands, K = 1 merges every H steps with token weights and the staleness rule."""
    return P2PSimulation(chips, islands, p, seed).run()
