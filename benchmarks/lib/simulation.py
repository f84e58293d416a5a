"""The goodput simulator's model (see benchmarks/simulator.py): its inputs, the virtual clock, data-parallel
and elastic data-parallel. p2p-diloco is in simulation_p2p."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

CHIP_YEAR_S = 365.25 * 86400.0
METHODS = ("data_parallel", "elastic_data_parallel", "p2p_diloco")
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


def rng_for(seed: int, method: str, chips: int, islands: int) -> np.random.Generator:
    """The random stream of one method at one chip and island count (every run of it draws the same)."""
    return np.random.default_rng([int(seed), METHODS.index(method), int(chips), int(islands)])


def time_to_next(rng: np.random.Generator, rate: float) -> float:
    """Time to the next event of a Poisson process of `rate` per second."""
    return float(rng.exponential(1.0 / rate)) if rate > 0 else math.inf


def checkpointed(trained_s: float, interval_s: float) -> float:
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
    rng = rng_for(seed, "data_parallel", chips, 1)
    rate, end = chips * p.chip_rate, p.duration_s
    queue = EventQueue()
    queue.push(time_to_next(rng, rate), FAIL)
    up, seg_start, saved_s, lost_s, failures = True, 0.0, 0.0, 0.0, 0
    while queue.next_time() < end:
        now, kind, _ = queue.pop()
        if kind == FAIL:
            trained = now - seg_start
            kept = checkpointed(trained, p.ckpt_interval_s)
            saved_s, lost_s, failures, up = saved_s + kept, lost_s + trained - kept, failures + 1, False
            queue.push(now + p.restart_s, RESTART)
        else:
            up, seg_start = True, now
            queue.push(now + time_to_next(rng, rate), FAIL)
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
    rng = rng_for(seed, "elastic_data_parallel", chips, 1)
    slices = max(1, round(chips / p.slice_chips))
    rate, end = chips * p.chip_rate, p.duration_s
    queue = EventQueue()
    queue.push(time_to_next(rng, rate), FAIL)
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
            queue.push(now + time_to_next(rng, rate), FAIL)
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
