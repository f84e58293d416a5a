"""Goodput at scale: a discrete-event simulation of data-parallel, elastic data-parallel and p2p-diloco.

No processes and no training: a virtual clock (a heapq event queue) drives failures, restarts, outer-step
boundaries and state pulls for one training job of `chips` chips, split into M islands for p2p-diloco. It is
the setting of the Decoupled DiLoCo paper's goodput table (arXiv 2604.21428: 88% for Decoupled DiLoCo vs 27%
for data-parallel at 1.2M chips, one interruption per chip-year), with every input a command-line flag.

    python benchmarks/simulator.py            # 150k..2.4M chips, M = 1, 2, 4, 8, 16, 14 virtual days
    python benchmarks/simulator.py --quick    # 3 chip counts, M = 1, 4, 16, 1 virtual day (a few seconds)

Writes benchmarks/results/simulator.json and simulator.png (simulator-quick.* with --quick): the rows, the
paper's figures, the comparison at 1.2M chips, a one-input-at-a-time sensitivity table and notes.

Model (all assumptions; see also "notes" in the JSON):

* Failures. Every chip is interrupted as a Poisson process of rate lambda = failures_per_chip_year / (365.25
  days). Failures are sampled per failure domain, never per chip: the whole data-parallel job (rate N*lambda),
  the elastic job (rate N*lambda, the failed slice drawn uniformly), or a p2p island of C = N/M chips (rate
  C*lambda). A failure that hits a unit which is already down (restarting, reconfiguring, pulling
  state) is absorbed by the recovery in progress: the spare is swapped in as part of it. This is optimistic for
  data-parallel, whose restarts are long compared to its time between failures at 1M+ chips.
* Goodput = useful training tokens / the tokens a failure-free run of the same chips does in the same wall-clock
  time (N * T / step_s, per-chip batch fixed). Every method has goodput 1 without failures (given that the
  p2p-diloco sync fits in its overlap window).
* data_parallel: one synchronous job. Any chip failure stops every chip; the job restarts in `restart_s` and
  resumes from its last checkpoint, taken every `ckpt_interval_s` of training (in memory / on peers, free), so
  the work since that checkpoint is lost. A renewal-theory formula for this case is in `analytic_data_parallel`.
* elastic_data_parallel: the job is made of slices of `slice_chips` chips. A failure removes its slice: every chip
  stalls `reconfig_s` while the mesh is rebuilt, the in-flight step is lost, and the job continues at reduced
  throughput while the slice restarts (`restart_s`); the slice rejoins at a step boundary without a global pause
  (optimistic). No rollback to a checkpoint.
* p2p_diloco with M islands of N/M chips: each island is an independent learner stepping every `step_s`. Outer
  steps happen on a global grid every H * step_s + sync stall (healthy islands have the same step time, so they arrive
  together, within the grace window, which is therefore not modelled further). Quorum K = 1: a merge happens
  when at least one island contributes; nobody waits for a dead island. Each contribution carries c_steps inner
  steps and c_tokens = c_steps * C tokens since the island last contributed; its merge weight is the real
  `p2p_diloco.diloco.merge.contribution_weight(rule, c_tokens, c_steps)` times the real
  `p2p_diloco.diloco.staleness.StalenessRule.factor(staleness)`, so a recovering island with fewer steps or an older
  anchor counts less; the merged step length (reported as `merged_inner_steps`) is computed with the real
  `weighted_mean`. Useful progress counts each accepted contribution's tokens times its staleness factor (a
  stale pseudo-gradient discounted by 0.5 is worth half its tokens); `goodput_undiscounted` counts accepted
  tokens in full, which is closer to a compute-time goodput.
  A failure stalls only its island, for `restart_s` (or `island_restart_s`); it keeps what its last in-memory
  checkpoint holds (the same `ckpt_interval_s` as data-parallel; the grid restarts at each outer step). The
  staleness of a contribution is the number of merges the swarm did since the anchor it was computed from.
  `--recovery pull` (default; Decoupled DiLoCo: "a restarted learner pulls a checkpoint from a healthy peer"):
  the restarted island sends the pseudo-gradient of its checkpoint, merged at the next outer step with its
  staleness (discounted, or rejected by the rule), and pulls the swarm's current state from a healthy peer
  (state_bytes / bandwidth), then trains from that fresh anchor. `--recovery checkpoint`: it resumes training
  from its own checkpoint on its old anchor, so everything it sends at the next outer step is stale; it pulls
  only when the rule would reject that contribution. With no healthy peer (M = 1) it always resumes its own
  checkpoint. Failures while pulling are absorbed like failures while restarting.
  Outer syncs send the pseudo-gradient (model_bytes) in a butterfly all-reduce, 2 (M-1)/M * model_bytes /
  bandwidth seconds, overlapped with the next `overlap_steps` (tau) inner steps: hidden if it fits, otherwise
  the island stalls for the excess after every outer step.
  M = 1 is DiLoCo on one island: one failure domain, so it fails, restarts and rolls back like data-parallel
  (no other island advances the clock while it is down, so its contributions are never stale).
* Restart, reconfiguration and pull times are deterministic; step times are equal on every island (no
  stragglers); checkpoints, inner-island communication and the outer optimizer cost nothing.

Defaults are chosen so that data-parallel lands in the paper's regime at 1.2M chips (restart_s = 60 s with a
5 s in-memory checkpoint gives ~27%); they are a calibration, not a reproduction of the paper's simulator.
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from p2p_diloco.diloco.merge import MERGE_RULES, contribution_weight, weighted_mean
from p2p_diloco.diloco.staleness import StalenessRule

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
CHIP_YEAR_S = 365.25 * 86400.0
METHODS = ("data_parallel", "elastic_data_parallel", "p2p_diloco")
FULL_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
FULL_ISLANDS = (1, 2, 4, 8, 16)
QUICK_CHIPS = (150_000, 1_200_000, 2_400_000)
QUICK_ISLANDS = (1, 4, 16)
PAPER = {
    "source": "Decoupled DiLoCo for Resilient Distributed Pre-training (arXiv 2604.21428), goodput table",
    "setting": "one interruption per chip-year, simulated chips",
    "chips": 1_200_000,
    "goodput": {"p2p_diloco": 0.88, "data_parallel": 0.27},
    "labels": {"p2p_diloco": "Decoupled DiLoCo", "data_parallel": "data-parallel"},
}

RECOVERY = ("pull", "checkpoint")
FAIL, RESTART, BOUNDARY, PULLED, RETURN = range(5)


@dataclass(frozen=True)
class Params:
    """Every input of the simulation; the CLI flags map one to one onto these fields."""

    failures_per_chip_year: float = 1.0
    restart_s: float = 60.0
    reconfig_s: float = 10.0
    ckpt_interval_s: float = 5.0
    step_s: float = 2.0
    inner_steps: int = 100
    overlap_steps: int = 10
    model_bytes: float = 2e10
    state_bytes: float = 6e10
    bandwidth_gbps: float = 25.0
    slice_chips: int = 4096
    days: float = 14.0
    merge: str = "tokens"
    max_staleness: int = 4
    discount: float = 0.5
    recovery: str = "pull"
    island_restart_s: float | None = None  # p2p island restart time; None: restart_s

    @property
    def island_restart(self) -> float:
        return self.restart_s if self.island_restart_s is None else self.island_restart_s

    @property
    def chip_rate(self) -> float:
        """Failures per chip per second."""
        return self.failures_per_chip_year / CHIP_YEAR_S

    @property
    def duration_s(self) -> float:
        return self.days * 86400.0

    @property
    def round_s(self) -> float:
        """Wall-clock time between outer steps for a healthy island."""
        return self.inner_steps * self.step_s

    def sync_s(self, islands: int) -> float:
        """Seconds to all-reduce one pseudo-gradient among `islands` islands (butterfly: 2 (M-1)/M of the payload)."""
        if islands <= 1:
            return 0.0
        return 2.0 * (islands - 1) / islands * self.model_bytes * 8.0 / (self.bandwidth_gbps * 1e9)

    def sync_stall_s(self, islands: int) -> float:
        """What of a sync does not fit behind `overlap_steps` inner steps."""
        return max(0.0, self.sync_s(islands) - self.overlap_steps * self.step_s)

    @property
    def pull_s(self) -> float:
        """Seconds for a rejected island to download the swarm's state from a healthy peer."""
        return self.state_bytes * 8.0 / (self.bandwidth_gbps * 1e9)


class EventQueue:
    """The virtual clock: a heap of (time, sequence, kind, who); the sequence breaks ties deterministically."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, int]] = []
        self._seq = 0

    def push(self, when: float, kind: int, who: int = 0) -> None:
        heapq.heappush(self._heap, (when, self._seq, kind, who))
        self._seq += 1

    def next_time(self) -> float:
        return self._heap[0][0] if self._heap else math.inf

    def pop(self) -> tuple[float, int, int]:
        when, _, kind, who = heapq.heappop(self._heap)
        return when, kind, who


def _rng(seed: int, method: str, chips: int, islands: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), METHODS.index(method), int(chips), int(islands)])


def _exp(rng: np.random.Generator, rate: float) -> float:
    """Time to the next event of a Poisson process of `rate` per second."""
    return float(rng.exponential(1.0 / rate)) if rate > 0 else math.inf


def _checkpointed(trained_s: float, interval_s: float) -> float:
    """Of `trained_s` seconds of training since the last restart, what the last checkpoint holds."""
    if interval_s <= 0:
        return trained_s
    return math.floor(trained_s / interval_s) * interval_s


def analytic_data_parallel(chips: int, p: Params) -> float:
    """Renewal-theory goodput of data_parallel: E[work checkpointed per up period] / E[up period + restart]."""
    rate = chips * p.chip_rate
    if rate <= 0:
        return 1.0
    c = p.ckpt_interval_s
    q = math.exp(-rate * c) if c > 0 else 1.0
    saved = c * q / (1.0 - q) if c > 0 else 1.0 / rate
    return saved / (1.0 / rate + p.restart_s)


def simulate_data_parallel(chips: int, p: Params, seed: int = 0) -> dict:
    """One synchronous job: every failure stops all chips for restart_s and rolls back to the last checkpoint."""
    rng = _rng(seed, "data_parallel", chips, 1)
    rate, end = chips * p.chip_rate, p.duration_s
    queue = EventQueue()
    queue.push(_exp(rng, rate), FAIL)
    up, seg_start, saved_s, lost_s, failures = True, 0.0, 0.0, 0.0, 0
    while queue.next_time() < end:
        now, kind, _ = queue.pop()
        if kind == FAIL:
            trained = now - seg_start
            kept = _checkpointed(trained, p.ckpt_interval_s)
            saved_s, lost_s, failures, up = saved_s + kept, lost_s + trained - kept, failures + 1, False
            queue.push(now + p.restart_s, RESTART)
        else:
            up, seg_start = True, now
            queue.push(now + _exp(rng, rate), FAIL)
    if up:
        saved_s += end - seg_start
    return {
        "chips": chips,
        "method": "data_parallel",
        "islands": 1,
        "goodput": saved_s / end,
        "failures": failures,
        "lost_work_fraction": lost_s / end,
        "analytic_goodput": analytic_data_parallel(chips, p),
    }


def simulate_elastic(chips: int, p: Params, seed: int = 0) -> dict:
    """Slices drop out on failure (all chips pause reconfig_s, in-flight step lost) and rejoin after restart_s."""
    rng = _rng(seed, "elastic_data_parallel", chips, 1)
    slices = max(1, round(chips / p.slice_chips))
    rate, end = chips * p.chip_rate, p.duration_s
    queue = EventQueue()
    queue.push(_exp(rng, rate), FAIL)
    down = np.zeros(slices, dtype=bool)
    live, paused_until, step_origin, last = slices, 0.0, 0.0, 0.0
    work = lost = 0.0  # in slice-seconds of training
    failures = absorbed = 0

    def advance(now: float) -> None:
        nonlocal work, last
        start = max(last, paused_until)
        if now > start:
            work += live * (now - start)
        last = now

    while queue.next_time() < end:
        now, kind, who = queue.pop()
        advance(now)
        if kind == FAIL:
            queue.push(now + _exp(rng, rate), FAIL)
            hit = int(rng.integers(slices))
            if down[hit]:
                absorbed += 1
                continue
            failures += 1
            if now >= paused_until:  # the step every live slice was computing is lost
                in_flight = live * ((now - step_origin) % p.step_s)
                work, lost = work - in_flight, lost + in_flight
            down[hit], live = True, live - 1
            paused_until = max(paused_until, now + p.reconfig_s)
            step_origin = paused_until
            queue.push(now + p.restart_s, RETURN, hit)
        else:
            down[who], live = False, live + 1
    advance(end)
    return {
        "chips": chips,
        "method": "elastic_data_parallel",
        "islands": 1,
        "goodput": work / (slices * end),
        "failures": failures,
        "absorbed_failures": absorbed,
        "slices": slices,
        "lost_work_fraction": lost / (slices * end),
    }


@dataclass
class _Island:
    up: bool = True
    pulling: bool = False
    seg_start: float = 0.0  # training (re)started here; the checkpoint grid starts here too
    banked_s: float = 0.0  # training since the last contribution that is safe in a checkpoint, before seg_start
    anchor: int = 0  # the merge this island's parameters descend from
    sent: list = field(default_factory=list)  # (steps, anchor): pseudo-gradients sent on recovery, merged next


def simulate_p2p(chips: int, islands: int, p: Params, seed: int = 0) -> dict:
    """M independent islands, K = 1 merges every H steps with token weights and the staleness rule."""
    if p.merge not in MERGE_RULES:
        raise ValueError(f"merge rule must be one of {MERGE_RULES}, got {p.merge!r}")
    if p.recovery not in RECOVERY:
        raise ValueError(f"recovery must be one of {RECOVERY}, got {p.recovery!r}")
    rng = _rng(seed, "p2p_diloco", chips, islands)
    rule = StalenessRule(max_staleness=p.max_staleness, discount=p.discount)
    size = chips / islands
    rate, end, stall = size * p.chip_rate, p.duration_s, p.sync_stall_s(islands)
    queue = EventQueue()
    state = [_Island() for _ in range(islands)]
    for index in range(islands):
        queue.push(_exp(rng, rate), FAIL, index)
    queue.push(p.round_s, BOUNDARY)
    merges = 0
    useful = accepted = 0.0  # tokens, in chip-steps
    counts = {"failures": 0, "contributions": 0, "stale_contributions": 0, "rejected": 0, "pulls": 0}
    lost_s = rejected_s = stall_s = 0.0
    merged_steps: list[float] = []

    def contribute(now: float, *, final: bool) -> None:
        """An outer step at `now`: every island with un-contributed work sends it; all up islands adopt the merge."""
        nonlocal merges, useful, accepted, stall_s, rejected_s
        deltas, weights = [], []
        for island in state:
            pending = island.sent
            island.sent = []
            if island.up and not island.pulling:
                pending.append(((island.banked_s + max(0.0, now - island.seg_start)) / p.step_s, island.anchor))
            elif final and not island.up:
                pending.append((island.banked_s / p.step_s, island.anchor))  # what it would send once restarted
            for steps, anchor in pending:
                if steps <= 0:
                    continue
                factor = rule.factor(merges - anchor)
                if factor is None:
                    counts["rejected"] += 1
                    rejected_s += steps * p.step_s
                    continue
                tokens = steps * size
                counts["contributions"] += 1
                counts["stale_contributions"] += factor < 1.0
                useful += tokens * factor
                accepted += tokens
                deltas.append(steps)
                weights.append(contribution_weight(p.merge, tokens, steps) * factor)
        if not deltas:
            return
        if sum(weights) > 0:
            # Each pseudo-gradient is summarised by its length in inner steps (one-element views of one tensor).
            merged_steps.append(float(weighted_mean(torch.tensor(deltas, dtype=torch.float64).unbind(), weights)))
        merges += 1
        for island in state:
            if island.up and not island.pulling:
                contributed = now > island.seg_start or island.banked_s > 0
                island.anchor, island.banked_s = merges, 0.0
                if contributed and stall > 0:
                    island.seg_start = now + stall
                    stall_s += stall
                else:
                    island.seg_start = max(island.seg_start, now)

    while queue.next_time() < end:
        now, kind, who = queue.pop()
        island = state[who]
        if kind == BOUNDARY:
            contribute(now, final=False)
            queue.push(now + p.round_s + stall, BOUNDARY)  # a healthy island's cadence: H steps, then its stall
        elif kind == FAIL:
            counts["failures"] += 1
            trained = max(0.0, now - island.seg_start)
            kept = _checkpointed(trained, p.ckpt_interval_s)
            island.banked_s += kept
            lost_s += trained - kept
            island.up = False
            queue.push(now + p.island_restart, RESTART, who)
        elif kind == RESTART:
            island.up = True
            peer = any(other.up and not other.pulling for other in state if other is not island)
            if p.recovery == "pull" and peer:
                # Send the checkpointed pseudo-gradient (judged by the staleness rule when merged), then start
                # over from the swarm's current state.
                if island.banked_s > 0:
                    island.sent.append((island.banked_s / p.step_s, island.anchor))
                pull = True
            else:
                # Resume from the island's own checkpoint (also what "pull" does with no healthy peer to pull
                # from, e.g. M = 1) unless the rule would reject its next contribution.
                pull = rule.factor(merges - island.anchor) is None
                if pull:
                    counts["rejected"] += 1
                    rejected_s += island.banked_s
            if pull:
                counts["pulls"] += 1
                island.banked_s, island.pulling = 0.0, True
                queue.push(now + p.pull_s, PULLED, who)
            else:
                island.seg_start = now
                queue.push(now + _exp(rng, rate), FAIL, who)
        else:  # PULLED: the swarm's current state, a fresh anchor
            island.pulling, island.anchor, island.seg_start = False, merges, now
            queue.push(now + _exp(rng, rate), FAIL, who)
    contribute(end, final=True)
    ideal = chips * end / p.step_s
    return {
        "chips": chips,
        "method": "p2p_diloco",
        "islands": islands,
        "goodput": useful / ideal,
        "goodput_undiscounted": accepted / ideal,
        **counts,
        "merges": merges,
        "merged_inner_steps": float(np.mean(merged_steps)) if merged_steps else 0.0,
        "lost_work_fraction": lost_s / (islands * end),
        "rejected_work_fraction": rejected_s / (islands * end),
        "sync_s": p.sync_s(islands),
        "sync_stall_fraction": stall_s / (islands * end),
    }


def simulate(method: str, chips: int, islands: int, p: Params, seed: int = 0) -> dict:
    """One row of the table."""
    if method == "data_parallel":
        return simulate_data_parallel(chips, p, seed)
    if method == "elastic_data_parallel":
        return simulate_elastic(chips, p, seed)
    if method == "p2p_diloco":
        return simulate_p2p(chips, islands, p, seed)
    raise ValueError(f"unknown method {method!r}; one of {METHODS}")


def run_grid(chips_list, islands_list, p: Params, seed: int = 0) -> list[dict]:
    """Every method at every chip count; p2p-diloco at every island count."""
    rows = []
    for chips in chips_list:
        rows.append(simulate("data_parallel", chips, 1, p, seed))
        rows.append(simulate("elastic_data_parallel", chips, 1, p, seed))
        for islands in islands_list:
            rows.append(simulate("p2p_diloco", chips, islands, p, seed))
    return rows


def column(row: dict) -> str:
    if row["method"] == "data_parallel":
        return "DP"
    if row["method"] == "elastic_data_parallel":
        return "elastic"
    return f"p2p M={row['islands']}"


def chips_label(chips: int) -> str:
    return f"{chips / 1e6:g}M" if chips >= 1_000_000 else f"{chips / 1e3:g}k"


def table(rows: list[dict], key: str = "goodput") -> str:
    """Rows = chip counts, columns = methods (p2p-diloco per island count), `key` in percent."""
    rows = [row for row in rows if key in row]
    columns = list(dict.fromkeys(column(row) for row in rows))
    chips_list = list(dict.fromkeys(row["chips"] for row in rows))
    cells = {(row["chips"], column(row)): row[key] for row in rows}
    lines = ["chips    " + "".join(f"{name:>11}" for name in columns)]
    for chips in chips_list:
        values = "".join(f"{100 * cells[(chips, name)]:>10.1f}%" for name in columns)
        lines.append(f"{chips_label(chips):<9}{values}")
    return "\n".join(lines)


def compare_with_paper(rows: list[dict]) -> dict:
    """The simulated rows at the paper's chip count, next to its figures."""
    chips = PAPER["chips"]
    at = [row for row in rows if row["chips"] == chips]
    if not at:
        return {"chips": chips, "note": "the paper's chip count was not simulated in this run"}
    dp = next(row for row in at if row["method"] == "data_parallel")
    elastic = next(row for row in at if row["method"] == "elastic_data_parallel")
    p2p = {str(row["islands"]): row for row in at if row["method"] == "p2p_diloco"}
    return {
        "chips": chips,
        "paper": PAPER["goodput"],
        "simulated": {
            "data_parallel": dp["goodput"],
            "data_parallel_analytic": dp["analytic_goodput"],
            "elastic_data_parallel": elastic["goodput"],
            "p2p_diloco": {m: row["goodput"] for m, row in p2p.items()},
            "p2p_diloco_undiscounted": {m: row["goodput_undiscounted"] for m, row in p2p.items()},
        },
        "difference_vs_paper": {
            "data_parallel": dp["goodput"] - PAPER["goodput"]["data_parallel"],
            "p2p_diloco": {m: row["goodput"] - PAPER["goodput"]["p2p_diloco"] for m, row in p2p.items()},
        },
    }


def notes(rows: list[dict], p: Params, variants: list[dict] | None = None) -> list[str]:
    """The modelling assumptions and why the numbers differ from the paper's."""
    rate_note = (
        f"Failures are Poisson per failure domain at {p.failures_per_chip_year:g} per chip-year: at 1.2M chips "
        f"the data-parallel job is interrupted every {1 / (1.2e6 * p.chip_rate):.0f} s on average."
        if p.chip_rate > 0
        else "Failure rate 0: every method has goodput 1."
    )
    out = [
        "Virtual clock (heapq event queue), no processes. " + rate_note,
        "Goodput = useful tokens / tokens of a failure-free run of the same chips over the same wall-clock time.",
        f"data_parallel: every failure stops all chips for restart_s = {p.restart_s:g} s and rolls back to a "
        f"checkpoint taken every {p.ckpt_interval_s:g} s (in memory, free); failures during a restart are absorbed "
        "(optimistic: otherwise restarts longer than the mean time between failures would rarely finish). "
        "analytic_goodput is the renewal-theory value of the same model and checks the event loop.",
        f"elastic_data_parallel: slices of {p.slice_chips} chips; a failure pauses every chip for reconfig_s = "
        f"{p.reconfig_s:g} s (a failure during a pause extends it) and loses the in-flight step ({p.step_s:g} s); "
        "the slice returns after restart_s without a pause. Unpaused time is ~exp(-N lambda reconfig_s), so it "
        "falls quickly past ~1M chips.",
        f"p2p_diloco: M islands of N/M chips, an outer step every H = {p.inner_steps} steps ({p.round_s:g} s), "
        f"quorum K = 1. Merge weights are p2p_diloco.diloco.merge.contribution_weight('{p.merge}', c_tokens, c_steps) "
        f"times StalenessRule(max_staleness={p.max_staleness}, discount={p.discount:g}).factor(staleness); the "
        "merged step length (merged_inner_steps) comes from p2p_diloco.diloco.merge.weighted_mean. goodput counts each "
        "accepted contribution's tokens times its staleness factor; goodput_undiscounted counts them in full.",
        f"p2p_diloco recovery = '{p.recovery}': a failed island is down {p.island_restart:g} s while the "
        "others keep stepping; "
        + (
            "it then sends the pseudo-gradient of its in-memory checkpoint (merged next, discounted by staleness or "
            f"rejected) and pulls the swarm's state from a healthy peer ({p.pull_s:g} s for {p.state_bytes:.3g} "
            f"bytes at {p.bandwidth_gbps:g} Gbit/s)."
            if p.recovery == "pull"
            else "it then resumes its own checkpoint on its old anchor (its next contribution is stale) and pulls "
            f"the swarm's state ({p.pull_s:g} s) only when the rule would reject that contribution."
        ),
        f"Outer sync: 2 (M-1)/M * {p.model_bytes:.3g} bytes at {p.bandwidth_gbps:g} Gbit/s, hidden behind "
        f"tau = {p.overlap_steps} inner steps ({p.overlap_steps * p.step_s:g} s) when it fits, else the island "
        "stalls for the excess (with the defaults it fits for every M).",
        "M = 1 p2p-diloco is DiLoCo on one island: one failure domain and no peer to pull from, so it restarts "
        "from its own checkpoint exactly like data-parallel (no staleness: no other island advances the clock).",
        "Not modelled: stragglers and unequal step times (so the grace window never matters), checkpoint and "
        "outer-optimizer costs, failures of links, correlated failures, restart-time variance.",
        "Calibration: restart_s = 60 s and ckpt_interval_s = 5 s were chosen so that data-parallel lands near the "
        "paper's 27% at 1.2M chips. Our notes on the paper give neither its restart model, its checkpoint policy, "
        "its goodput definition nor the learner count behind 88%, so only the regime is matched.",
    ]
    chips = PAPER["chips"]
    dp = next((r for r in rows if r["chips"] == chips and r["method"] == "data_parallel"), None)
    p2p = sorted((r for r in rows if r["chips"] == chips and r["method"] == "p2p_diloco"), key=lambda r: r["islands"])
    if dp and p2p:
        best = p2p[-1]
        out.append(
            f"At 1.2M chips: data-parallel {100 * dp['goodput']:.1f}% (paper 27%); p2p-diloco "
            + ", ".join(f"M={r['islands']} {100 * r['goodput']:.1f}%" for r in p2p)
            + f" (paper 88%); M={best['islands']} with stale tokens undiscounted "
            f"{100 * best['goodput_undiscounted']:.1f}%."
        )
        out.append(
            "Why p2p-diloco differs from 88%: (1) the island count matters most: an island of N/M chips is down a "
            "fraction ~ (N/M) lambda (restart_s + pull) of the time, so at 1.2M chips only M >= 16 reaches the "
            "80s; (2) goodput here charges stale pseudo-gradients by the staleness rule (tokens x discount**s), "
            "whereas a compute-time goodput (goodput_undiscounted) does not; (3) by default an island restart "
            "costs the same restart_s as a whole data-parallel restart, plus a state pull, while the paper's "
            "learners may restart faster than a 1.2M-chip job (see the island_restart_s sensitivity row); "
            "(4) the paper's own failure and recovery simulator is not reproduced, only its setting (chip counts, "
            "one interruption per chip-year)."
        )
        out.append(
            "Why data-parallel differs from 27%: restart_s was calibrated to it; the residual comes from the "
            "checkpoint grid (on average a little under ckpt_interval_s / 2 lost per failure) and from sampling noise."
        )
    if variants:
        by = {v["change"]: v for v in variants}
        keys = [k for k in variants[0] if k.startswith("p2p_diloco_M") and not k.endswith("undiscounted")]
        if keys and "restart_s=30" in by:
            key = keys[-1]
            out.append(
                f"Sensitivity at 1.2M chips ({key}): restart_s 30 s gives {100 * by['restart_s=30'][key]:.1f}% "
                f"(data-parallel {100 * by['restart_s=30']['data_parallel']:.1f}%), 120 s gives "
                f"{100 * by['restart_s=120'][key]:.1f}% "
                f"(data-parallel {100 * by['restart_s=120']['data_parallel']:.1f}%)"
                f"; no staleness discount {100 * by['discount=1 (stale tokens in full)'][key]:.1f}%; "
                f"recovery=checkpoint {100 * by['recovery=checkpoint'][key]:.1f}%; a 5 Gbit/s link "
                f"{100 * by['bandwidth 5 Gbit/s'][key]:.1f}% (the sync no longer hides behind tau steps); islands "
                f"restarting in 30 s while the data-parallel job still takes 60 s: "
                f"{100 * by['island restart 30 s, job restart 60 s'][key]:.1f}% vs "
                f"{100 * by['island restart 30 s, job restart 60 s']['data_parallel']:.1f}%, close to the paper's "
                "pair (88%, 27%): a failure domain of 75k chips can plausibly restart faster than a 1.2M-chip job."
            )
    return out


SENSITIVITY = (
    ("defaults", {}),
    ("recovery=checkpoint", {"recovery": "checkpoint"}),
    ("discount=1 (stale tokens in full)", {"discount": 1.0}),
    ("restart_s=30", {"restart_s": 30.0}),
    ("restart_s=120", {"restart_s": 120.0}),
    ("island restart 30 s, job restart 60 s", {"island_restart_s": 30.0}),
    ("ckpt_interval_s=0 (nothing lost)", {"ckpt_interval_s": 0.0}),
    ("H=50", {"inner_steps": 50}),
    ("bandwidth 5 Gbit/s", {"bandwidth_gbps": 5.0}),
)


def sensitivity(islands_list, p: Params, seed: int = 0) -> list[dict]:
    """At the paper's chip count: data-parallel and p2p-diloco at the two largest island counts, one input changed."""
    chips = PAPER["chips"]
    counts = sorted(set(islands_list))[-2:]
    out = []
    for change, fields in SENSITIVITY:
        variant = replace(p, **fields)
        entry = {"change": change, "data_parallel": simulate_data_parallel(chips, variant, seed)["goodput"]}
        for islands in counts:
            row = simulate_p2p(chips, islands, variant, seed)
            entry[f"p2p_diloco_M{islands}"] = row["goodput"]
            entry[f"p2p_diloco_M{islands}_undiscounted"] = row["goodput_undiscounted"]
        out.append(entry)
    return out


def sensitivity_table(entries: list[dict]) -> str:
    keys = [key for key in entries[0] if key != "change"]
    lines = [
        f"{'at 1.2M chips':<40}"
        + "".join(f"{key.replace('p2p_diloco_', 'p2p ').replace('_undiscounted', ' undisc.'):>17}" for key in keys)
    ]
    for entry in entries:
        lines.append(f"{entry['change']:<40}" + "".join(f"{100 * entry[key]:>16.1f}%" for key in keys))
    return "\n".join(lines)


def machine() -> dict:
    """Where the benchmark ran."""
    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Goodput vs chips (log x), one line per method / island count, the paper's figures marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        series.setdefault(column(row), []).append((row["chips"], row["goodput"]))
    styles = {"DP": ("black", "o", "-"), "elastic": ("tab:gray", "s", "--")}
    p2p_names = [name for name in series if name.startswith("p2p")]
    cmap = plt.get_cmap("viridis")
    for index, name in enumerate(p2p_names):
        styles[name] = (cmap(index / max(1, len(p2p_names) - 1) * 0.9), "^", "-")
    for name, points in series.items():
        color, marker, line = styles[name]
        xs, ys = zip(*sorted(points))
        label = {"DP": "data-parallel", "elastic": "elastic data-parallel"}.get(name, f"p2p-diloco, {name[4:]}")
        ax.plot(xs, [100 * y for y in ys], marker=marker, linestyle=line, color=color, label=label)
        if name.startswith("p2p"):
            full = sorted((row["chips"], row["goodput_undiscounted"]) for row in rows if column(row) == name)
            ax.plot(
                [x for x, _ in full],
                [100 * y for _, y in full],
                linestyle=":",
                color=color,
                alpha=0.6,
                label="p2p-diloco, stale tokens undiscounted" if name == p2p_names[-1] else None,
            )
    chips = PAPER["chips"]
    ax.scatter(
        [chips],
        [100 * PAPER["goodput"]["p2p_diloco"]],
        marker="*",
        s=260,
        color="tab:red",
        zorder=5,
        label="paper: Decoupled DiLoCo 88%",
    )
    ax.scatter(
        [chips],
        [100 * PAPER["goodput"]["data_parallel"]],
        marker="X",
        s=160,
        color="tab:red",
        zorder=5,
        label="paper: data-parallel 27%",
    )
    ax.set_xscale("log")
    all_chips = sorted({row["chips"] for row in rows})
    ax.set_xticks(all_chips)
    ax.set_xticklabels([chips_label(c) for c in all_chips])
    ax.minorticks_off()
    ax.set_ylim(0, 102)
    ax.set_xlabel("chips (one interruption per chip-year)")
    ax.set_ylabel("goodput (%)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_count(text: str) -> int:
    """'150k', '1.2M', '2400000' -> an int."""
    text = text.strip()
    scale = {"k": 1e3, "K": 1e3, "m": 1e6, "M": 1e6}.get(text[-1:], 1.0)
    if scale != 1.0:
        text = text[:-1]
    return int(round(float(text) * scale))


def parse_list(text: str) -> list[int]:
    return [parse_count(item) for item in text.split(",") if item.strip()]


def build_parser() -> argparse.ArgumentParser:
    d = Params()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 chip counts, M = 1, 4, 16, 1 virtual day")
    parser.add_argument("--chips", type=parse_list, help="chip counts, e.g. 150k,300k,600k,1.2M,2.4M")
    parser.add_argument("--islands", type=parse_list, help="p2p-diloco island counts, e.g. 1,2,4,8,16")
    parser.add_argument("--failures-per-chip-year", type=float, default=d.failures_per_chip_year)
    parser.add_argument("--restart-s", type=float, default=d.restart_s, help="job, slice or island restart time")
    parser.add_argument("--island-restart-s", type=float, help="p2p island restart time (default: --restart-s)")
    parser.add_argument("--reconfig-s", type=float, default=d.reconfig_s, help="elastic: global pause per failure")
    parser.add_argument("--ckpt-interval-s", type=float, default=d.ckpt_interval_s, help="0: no work lost")
    parser.add_argument("--step-s", type=float, default=d.step_s, help="inner step time (every island)")
    parser.add_argument("--inner-steps", "-H", type=int, default=d.inner_steps, help="H, steps per outer step")
    parser.add_argument("--overlap-steps", type=int, default=d.overlap_steps, help="tau, steps a sync may hide in")
    parser.add_argument("--model-bytes", type=float, default=d.model_bytes, help="pseudo-gradient payload")
    parser.add_argument("--state-bytes", type=float, default=d.state_bytes, help="state pulled from a peer")
    parser.add_argument("--bandwidth-gbps", type=float, default=d.bandwidth_gbps, help="inter-island link")
    parser.add_argument("--slice-chips", type=int, default=d.slice_chips, help="elastic: chips per slice")
    parser.add_argument("--days", type=float, help=f"virtual duration (default {d.days:g}, quick 1)")
    parser.add_argument("--merge", choices=MERGE_RULES, default=d.merge, help="merge weight rule")
    parser.add_argument("--max-staleness", type=int, default=d.max_staleness)
    parser.add_argument("--discount", type=float, default=d.discount)
    parser.add_argument(
        "--recovery",
        choices=RECOVERY,
        default=d.recovery,
        help="p2p island restart: pull the swarm's state, or resume its own checkpoint",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS), help="folder for simulator.json and simulator.png")
    return parser


def main(argv: list | None = None) -> int:
    """Simulate the grid, print the table, write simulator.json / .png (simulator-quick.* with --quick)."""
    argv = [str(arg) for arg in argv] if argv is not None else sys.argv[1:]
    args = build_parser().parse_args(argv)
    params = Params(
        failures_per_chip_year=args.failures_per_chip_year,
        restart_s=args.restart_s,
        reconfig_s=args.reconfig_s,
        ckpt_interval_s=args.ckpt_interval_s,
        step_s=args.step_s,
        inner_steps=args.inner_steps,
        overlap_steps=args.overlap_steps,
        model_bytes=args.model_bytes,
        state_bytes=args.state_bytes,
        bandwidth_gbps=args.bandwidth_gbps,
        slice_chips=args.slice_chips,
        merge=args.merge,
        max_staleness=args.max_staleness,
        discount=args.discount,
        recovery=args.recovery,
        island_restart_s=args.island_restart_s,
    )
    params = replace(params, days=args.days if args.days is not None else (1.0 if args.quick else Params.days))
    chips_list = args.chips or list(QUICK_CHIPS if args.quick else FULL_CHIPS)
    islands_list = args.islands or list(QUICK_ISLANDS if args.quick else FULL_ISLANDS)
    started = time.monotonic()
    rows = run_grid(chips_list, islands_list, params, args.seed)
    elapsed = time.monotonic() - started
    print(table(rows))
    print("\np2p-diloco, stale tokens counted in full (goodput_undiscounted):")
    print(table(rows, "goodput_undiscounted"))
    comparison = compare_with_paper(rows)
    if "simulated" in comparison:
        sim = comparison["simulated"]
        p2p = ", ".join(f"M={m} {100 * g:.1f}%" for m, g in sim["p2p_diloco"].items())
        print("\npaper at 1.2M chips: Decoupled DiLoCo 88%, data-parallel 27%")
        print(
            f"simulated:           data-parallel {100 * sim['data_parallel']:.1f}% "
            f"(analytic {100 * sim['data_parallel_analytic']:.1f}%), p2p-diloco {p2p}"
        )
    variants = sensitivity(islands_list, params, args.seed)
    print("\nsensitivity (one input changed at a time):")
    print(sensitivity_table(variants))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "simulator-quick" if args.quick else "simulator"
    result = {
        "command": " ".join(["python benchmarks/simulator.py", *argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "wall_s": round(elapsed, 2),
        "seed": args.seed,
        "params": {
            **asdict(params),
            "duration_s": params.duration_s,
            "round_s": params.round_s,
            "pull_s": params.pull_s,
            "chip_rate_per_s": params.chip_rate,
        },
        "chips": chips_list,
        "islands": islands_list,
        "rows": rows,
        "paper": PAPER,
        "comparison": comparison,
        "sensitivity_at_1_2M_chips": variants,
        "notes": notes(rows, params, variants),
    }
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    title = f"Goodput at scale, {params.failures_per_chip_year:g} interruption/chip-year, {params.days:g} virtual days"
    plot(rows, out / f"{name}.png", title)
    print(f"\nwrote {out / (name + '.json')} and {out / (name + '.png')} ({elapsed:.1f}s of simulation)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
