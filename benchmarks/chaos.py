"""Goodput under failures: islands are SIGKILLed (and restarted) and SIGSTOPped on a seeded schedule.

The same schedule runs against p2p-diloco's default decoupled mode (quorum K=1, adaptive grace), a synchronous
mode where every island waits for the whole swarm, and the decoupled mode with a standby per island (`--standby
true`: a killed island's standby takes over at once), each also once without faults. Reports
goodput (useful training tokens per second summed over islands, relative to the same mode without faults),
the final eval loss, the time from a restart to the restarted island's first merged round, and whether any
island exited with an error it should have survived. Each island runs under a CPU quota of the machine's cores /
islands (`--island-cpus`, `lib/cpu_quota.py`, in 10 ms periods), as on a machine of its own: without one, a dead
island's CPU sped the others up and a restarting island's imports slowed them down.

    python benchmarks/chaos.py            # 5 islands, 90 s per run, 6 runs (about 11 minutes)
    python benchmarks/chaos.py --extended # and the standby mode's 2 runs (make bench-all; about 14 minutes)
    python benchmarks/chaos.py --modes standby  # one mode; the others carried over from the last result
    python benchmarks/chaos.py --quick    # 3 islands, 22 s per run, the decoupled mode only
    python benchmarks/chaos.py --smoke    # 3 islands, tiny model, short runs (used by the tests)
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from lib.common import TINY, benchmark_parser, provenance, write_result
from lib.cpu_quota import CpuQuotas

from p2p_diloco.cli.launcher import LocalSwarm, PeerProcess
from p2p_diloco.island.ownership import LOCK_NAME

MODES = {"decoupled": [], "synchronous": ["--quorum", "{n}", "--averaging-timeout", "60"], "standby": []}
EXTENDED_MODES = {"standby"}
"""Run only with --extended (make bench-all) or --smoke; a plain run carries their figures over from the last
result of the same schedule, dated: standby changes only with the takeover code, and its two runs are a quarter of
the time."""
QUICK_MODES = {"decoupled"}
"""What --quick measures (a check that a fault schedule still runs, in about a minute and a half): the synchronous
mode's figure moves only with the quorum code, and is carried over like the extended ones."""
# standby: the decoupled mode with a standby per island (`--standby true`, under the island's CPU quota) that takes
# over at a kill; the scheduled restart starts the next standby. The schedule and a window of `budget` seconds start
# once every standby is warm; the harness stops every island at the window's end (SIGTERM), and only rounds recorded
# in the window count.
# mode: islands, budget, kill_every, restart_after, stop_every, stop_for
PRESETS = {
    "smoke": (3, 26.0, 9.0, 4.0, 14.0, 4.0),
    "quick": (3, 22.0, 9.0, 4.0, 14.0, 4.0),
    "full": (5, 90.0, 30.0, 10.0, 40.0, 8.0),
}


@dataclass
class Schedule:
    """Seeded fault schedule: (time, action, island) with action kill/restart/stop/cont."""

    events: list[tuple[float, str, int]] = field(default_factory=list)

    @classmethod
    def make(
        cls,
        *,
        seed: int,
        islands: int,
        budget: float,
        kill_every: float,
        restart_after: float,
        stop_every: float,
        stop_for: float,
    ) -> Schedule:
        rng = random.Random(seed)
        events = []
        down_until = [0.0] * islands
        t = kill_every
        while t + restart_after < budget - 5:
            victim = rng.choice([i for i in range(islands) if down_until[i] <= t])
            events += [(t, "kill", victim), (t + restart_after, "restart", victim)]
            down_until[victim] = t + restart_after
            t += kill_every
        t = stop_every / 2
        while t + stop_for < budget - 5:
            candidates = [i for i in range(islands) if down_until[i] <= t]
            if candidates:
                frozen = rng.choice(candidates)
                events += [(t, "stop", frozen), (t + stop_for, "cont", frozen)]
                down_until[frozen] = max(down_until[frozen], t + stop_for)
            t += stop_every
        return cls(sorted(events))


@dataclass
class Faults:
    """What the injector did during one run."""

    kills: int = 0
    kill_times: list[tuple[int, float]] = field(default_factory=list)
    """(island, wall-clock time) of every kill."""
    restarts: list[tuple[int, float]] = field(default_factory=list)
    """(island, wall-clock time) of every restart."""

    def next_kill(self, island: int, after: float) -> float:
        """When `island` was next killed after `after` (inf if never): where that incarnation ended."""
        return min((t for i, t in self.kill_times if i == island and t > after), default=float("inf"))


class ChaosSwarm:
    """A bootstrap and islands of one mode, each with the time left of the run's budget when (re)started."""

    def __init__(
        self, mode: str, *, islands: int, budget: float, inner_steps: int, tiny: bool, folder: Path, quotas: CpuQuotas
    ):
        self.mode, self.islands, self.budget, self.inner_steps = mode, islands, budget, inner_steps
        self.config = TINY if tiny else None
        self.swarm = LocalSwarm(folder, run_id=f"chaos-{mode}")
        self.quotas = quotas
        self.started = time.monotonic()
        self.standbys: dict[int, PeerProcess] = {}
        self.deadline_wall = time.time() + budget

    def island(self, index: int) -> PeerProcess:
        """The island's current process."""
        return self.swarm.peers[f"island-{index}"]

    def start(self, index: int, remaining: float) -> PeerProcess:
        """Start island `index` (again) for `remaining` seconds: it resumes from its checkpoint, appends metrics."""
        flags = [flag.format(n=self.islands) for flag in MODES[self.mode]]
        args = ["--shard-index", str(index), "--num-shards", str(self.islands), "--outer-steps", "100000"]
        # Standby mode: the harness stops every island at the window's end, which starts only once the standbys are
        # warm, after the islands' own budgets (counted from their join) would have begun.
        budget = "0" if self.mode == "standby" else str(max(1.0, remaining))
        args += ["--time-budget-s", budget, "--inner-steps", str(self.inner_steps)]
        args += ["--target-group-size", str(self.islands), "--next-chunk-timeout", "3", "--batch-size", "8", *flags]
        return self.swarm.peer(f"island-{index}", *args, config=self.config, command_prefix=self.quotas.prefix(index))

    def start_standby(self, index: int) -> None:
        """A standby for island `index`: its flags, no budget of its own (the harness stops it at the end)."""
        self.standbys[index] = self.swarm.standby(f"island-{index}", "--time-budget-s", "0")

    def stop_at_deadline(self) -> None:
        """Standby mode: at the budget's end, stop every island and standby still running (SIGTERM)."""
        time.sleep(max(0.0, self.deadline_wall - time.time()))  # the harness's clock, as the fault schedule's
        for peer in [*self.swarm.peers.values(), *self.standbys.values()]:
            if peer.running:
                peer.process.send_signal(signal.SIGTERM)

    def run(self, schedule: Schedule | None) -> Faults:
        """Start every island, inject the faults, wait for every island to finish its budget; stop everything."""
        try:
            self.swarm.bootstrap()
            self.started, self.deadline_wall = time.monotonic(), time.time() + self.budget
            for index in range(self.islands):
                self.start(index, self.budget)
            if self.mode == "standby":  # each once its island holds the folder: it would take a free one itself
                for index in range(self.islands):
                    wait_until_folder_held(self.island(index))
                    self.start_standby(index)
                # The schedule and the counted window start once every standby is warm: a kill before that tests a
                # cold start, and on a slow host (islands 18 s to start in CI) it left the standby too little time.
                for standby in self.standbys.values():
                    wait_until_standby_waits(standby)
                self.started, self.deadline_wall = time.monotonic(), time.time() + self.budget
            faults = self.inject(schedule.events if schedule else [])
            if self.mode == "standby":
                self.stop_at_deadline()
            for peer in [*self.swarm.peers.values(), *self.standbys.values()]:
                peer.wait(max(30.0, self.budget - (time.monotonic() - self.started) + 120))
        finally:
            self.swarm.close()  # wakes frozen islands first
            self.quotas.close()
        return faults

    def inject(self, events: list[tuple[float, str, int]]) -> Faults:
        """Kill, restart, freeze and wake islands at the scheduled times."""
        faults = Faults()
        for at, action, index in events:
            delay = self.started + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # the injector's clock: faults happen at scheduled times
            island = self.island(index)
            if action == "kill" and island.running:
                island.process.send_signal(signal.SIGKILL)  # the island alone: its DHT and p2pd must follow it
                island.process.wait()
                faults.kills += 1
                faults.kill_times.append((index, time.time()))
                if index in self.standbys:  # it takes over now: the restart is the kill
                    self.swarm.promote(self.standbys.pop(index))
                    faults.restarts.append((index, time.time()))
            elif action == "restart" and self.mode == "standby":
                self.start_standby(index)
            elif action == "restart":
                self.start(index, self.budget - (time.monotonic() - self.started))
                faults.restarts.append((index, time.time()))
            elif action in ("stop", "cont") and island.running:
                island.signal_group(signal.SIGSTOP if action == "stop" else signal.SIGCONT)
        return faults


def wait_until_folder_held(peer: PeerProcess, timeout: float = 120.0) -> bool:
    """Whether `peer`'s process took its checkpoint folder (the lock file names its pid) before it ended or `timeout`.

    flock offers no notification, and a probe of the lock would itself make the island's own attempt fail: this
    reads the owner the island writes into the lock file once it holds it.
    """
    lock, owner = peer.checkpoint_dir / LOCK_NAME, f"pid {peer.process.pid} "
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and peer.running:
        try:
            if lock.read_text().startswith(owner):
                return True
        except OSError:
            pass  # not created yet
        time.sleep(0.05)
    return False


def wait_until_standby_waits(standby: PeerProcess, timeout: float = 120.0) -> bool:
    """Whether `standby` is warm (imports, model and data done) and waits for its folder, before it ended or
    `timeout`: its log says so (`ownership.FolderOwnership.wait`), the one sign it gives."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and standby.running:
        if "standby: waiting to take over" in standby.log_text():
            return True
        time.sleep(0.05)
    return False


def useful_tokens(records: dict[int, list[dict]], until: float = float("inf"), since: float = 0.0) -> int:
    """Training tokens of every round that reached the swarm's model, recorded after wall time `since` and by
    `until`, summed over islands: not a round merged as stale, nor one the island stepped alone (no group) and then
    dropped when its next round realigned it to the swarm's anchor (`dropped_solo_rounds`)."""
    useful = 0
    for recs in records.values():
        previous = 0
        for record, dropped in zip(recs, _dropped_by_resync(recs)):
            gained = record["tokens"] - previous
            previous = record["tokens"]
            counted = since < record["time"] <= until
            if counted and not dropped and not (record.get("note") or "").count("stale"):
                useful += max(0, gained)
    return useful


def _dropped_by_resync(recs: list[dict]) -> list[bool]:
    """Per round: stepped alone, and the next round resynced the anchor (so that solo step was thrown away)."""
    return [not r["partners"] and bool(n.get("resynced")) for r, n in zip(recs, recs[1:])] + [False] * bool(recs)


def dropped_solo_rounds(records: dict[int, list[dict]]) -> int:
    """Rounds an island stepped alone and then dropped by a resync, summed over islands."""
    return sum(sum(_dropped_by_resync(recs)) for recs in records.values())


def waiting_island_s(records: dict[int, list[dict]]) -> float:
    """Island-seconds spent blocked on the swarm (matchmaking, all-reduce, resync), summed over every round."""
    return sum(float(r.get("wait_s") or 0.0) for recs in records.values() for r in recs)


def lost_at_kills_island_s(records: dict[int, list[dict]], faults: Faults, started_wall: float) -> float:
    """Island-seconds of training a kill threw away: from the killed incarnation's last recorded round (or its
    start) to the kill, work that never reached a merge."""
    lost = 0.0
    for index, killed_at in faults.kill_times:
        began = max([started_wall] + [t for i, t in faults.restarts if i == index and t < killed_at])
        recorded = [r["time"] for r in records[index] if began < r["time"] < killed_at]
        lost += killed_at - max([began, *recorded])
    return lost


def median_step_s(records: dict[int, list[dict]]) -> float | None:
    """Median seconds per inner step over a run's rounds: how fast this shared machine ran during the run (a frozen
    island's stretched round is an outlier the median ignores)."""
    per_step = [r["compute_s"] / r["inner_steps"] for recs in records.values() for r in recs if r.get("inner_steps")]
    return statistics.median(per_step) if per_step else None


def recovery_times(records: dict[int, list[dict]], faults: Faults) -> tuple[list[float | None], int]:
    """Seconds from each restart to the island's first merged round, and how many were killed before one."""
    recovery, killed_before_merging = [], 0
    for index, restarted_at in faults.restarts:
        # Only this incarnation counts: an island killed again before it merged has no recovery time.
        next_kill = faults.next_kill(index, restarted_at)
        merged_after = [r["time"] for r in records[index] if restarted_at < r["time"] < next_kill and r["partners"] > 0]
        if merged_after:
            recovery.append(merged_after[0] - restarted_at)
        elif next_kill < float("inf"):
            killed_before_merging += 1
        else:
            recovery.append(None)
    return recovery, killed_before_merging


STARTUP_PHASES = ("process_start_s", "join_s", "restore_s")


def restart_breakdown(records: dict[int, list[dict]], faults: Faults) -> list[dict]:
    """Where each restart's time went until its first merged round: the start-up phases its first record names,
    then the first round itself (inner steps, matchmaking, the merge)."""
    phases = []
    for index, restarted_at in faults.restarts:
        # This incarnation only: one killed again before it merged has no breakdown (recovery_times counts it).
        next_kill = faults.next_kill(index, restarted_at)
        after = [r for r in records[index] if restarted_at < r["time"] < next_kill]
        first = next((r for r in after if r.get("process_start_s") is not None), None)
        merged = next((r for r in after if r["partners"] > 0), None)
        if first is None or merged is None:
            continue
        startup = {phase: first.get(phase) or 0.0 for phase in STARTUP_PHASES}
        total = merged["time"] - restarted_at
        phases.append({"island": index, **startup, "first_round_s": total - sum(startup.values()), "total_s": total})
    return phases


def schedule_downtime(schedule: Schedule | None, kills: bool = True) -> float:
    """Island-seconds the schedule itself takes away: killed until restarted (unless a standby takes over at once:
    not `kills`), frozen until woken."""
    pending: dict[tuple[str, int], float] = {}
    down = 0.0
    for at, action, index in schedule.events if schedule else []:
        if action in ("kill", "restart") and not kills:
            continue
        if action in ("kill", "stop"):
            pending[(action, index)] = at
        else:
            down += at - pending.pop(("kill" if action == "restart" else "stop", index), at)
    return down


def unexpected_errors(chaos: ChaosSwarm, folder: Path) -> list[str]:
    """Islands whose last process exited with an error, and every island that gave up with an error."""
    expected = (0, 143) if chaos.mode == "standby" else (0,)  # standby mode stops its islands with SIGTERM
    errors = [
        f"island-{index} exited {chaos.island(index).process.returncode}"
        for index in range(chaos.islands)
        if chaos.island(index).process.returncode not in expected
    ]
    # hivemind logs every failed round with a traceback; what counts is an island giving up with an error.
    fatal = sorted(
        f"{path.name}: {line.strip()}"
        for path in folder.glob("island-*.log*")
        for line in path.read_text(errors="replace").splitlines()
        if line.startswith("p2p-diloco peer: error")
    )
    return errors + fatal


def run(mode: str, schedule: Schedule | None, *, budget: float, folder: Path, **swarm) -> dict:
    """One run of `budget` seconds (`swarm`: ChaosSwarm's other settings); returns its measurements."""
    shutil.rmtree(folder, ignore_errors=True)  # an earlier run's checkpoints would be resumed from
    chaos = ChaosSwarm(mode, budget=budget, folder=folder, **swarm)
    islands = chaos.islands
    faults = chaos.run(schedule)
    wall = time.monotonic() - chaos.started
    records = {index: chaos.island(index).records() for index in range(islands)}
    if mode == "standby":  # the harness's window: it stops every island at its end
        useful = useful_tokens(records, since=chaos.deadline_wall - budget, until=chaos.deadline_wall)
    else:
        useful = useful_tokens(records)
    recovery, killed_before_merging = recovery_times(records, faults)
    final = [recs[-1]["eval_loss"] for recs in records.values() if recs]
    return {
        "mode": mode,
        "faults": schedule is not None,
        "useful_tokens": useful,
        "goodput_tokens_per_s": useful / budget,
        "final_eval_loss": sum(final) / len(final) if final else None,
        "restart_to_first_merge_s": recovery,
        "restarts_killed_before_merging": killed_before_merging,
        "restart_breakdown": restart_breakdown(records, faults),
        "schedule_downtime_island_s": schedule_downtime(schedule, kills=mode != "standby"),
        "waiting_island_s": waiting_island_s(records),
        "median_step_s": median_step_s(records),
        "rounds_without_partners": sum(1 for recs in records.values() for r in recs if not r["partners"]),
        "resyncs": sum(1 for recs in records.values() for r in recs if r.get("resynced")),
        "dropped_solo_rounds": dropped_solo_rounds(records),
        "lost_at_kills_island_s": lost_at_kills_island_s(records, faults, chaos.deadline_wall - budget),
        "errors": unexpected_errors(chaos, folder),
        "kills": faults.kills,
        "wall_s": wall,
    }


def plot(result: dict, path: Path) -> None:
    """Goodput and final eval loss per mode, with and without faults."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    carried = result.get("carried_over", {})
    labels = [
        f"{r['mode']}\n{'faults' if r['faults'] else 'no faults'}"
        + (f"\n({carried[r['mode']][:10]})" if r["mode"] in carried else "")
        for r in runs
    ]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].bar(range(len(runs)), [r["goodput_tokens_per_s"] for r in runs], color="tab:green")
    axes[0].set_title("goodput (useful tokens/s, all islands)")
    axes[1].bar(range(len(runs)), [r["final_eval_loss"] or 0 for r in runs], color="tab:blue")
    axes[1].set_title("final eval loss")
    for axis in axes:
        axis.set_xticks(range(len(runs)), labels, fontsize=8)
        axis.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Chaos: {result['islands']} islands, kills every {result['schedule']['kill_every']}s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_all(
    schedule: Schedule,
    islands: int,
    budget: float,
    *,
    smoke: bool,
    out: Path,
    quotas: CpuQuotas,
    pairs: int = 1,
    modes: tuple[str, ...] = tuple(MODES),
) -> list[dict]:
    """Every mode, each without and with the fault schedule; the decoupled mode's pair `pairs` times (a clean run's
    tokens alone moved 7% between two runs on this shared machine, the goodput with it)."""
    runs = []
    for mode in modes:
        for pair, faults in itertools.product(range(pairs if mode == "decoupled" else 1), (False, True)):
            label = f"{mode}-{'faults' if faults else 'clean'}" + (f"-{pair}" if pair else "")
            print(f"== {label}: {islands} islands, {budget:.0f}s", flush=True)
            row = run(
                mode,
                schedule if faults else None,
                islands=islands,
                budget=budget,
                inner_steps=10 if smoke else 20,
                tiny=smoke,
                folder=out / "chaos-runs" / label,
                quotas=quotas,
            )
            runs.append({**row, "pair": pair})
            print(
                f"   goodput {row['goodput_tokens_per_s']:.0f} tok/s  eval {row['final_eval_loss']}  "
                f"recovery {row['restart_to_first_merge_s']}  errors {row['errors']}",
                flush=True,
            )
    return runs


def goodput_breakdown(faulty: dict, clean: dict, goodput: float, islands: int, budget: float) -> dict:
    """Shares of the clean run's tokens: kept (the goodput), taken by the schedule (killed until restarted, frozen),
    spent restarting (process start, join, state), thrown away by kills (training since the last merge), waited
    on the swarm beyond the clean run's share (frozen or dead partners, failed groups), and the rest (stale merges,
    slower rounds)."""
    capacity = islands * budget
    scheduled = faulty["schedule_downtime_island_s"] / capacity
    restarting = sum(sum(r[p] for p in STARTUP_PHASES) for r in faulty["restart_breakdown"]) / capacity
    shares = {"goodput": goodput, "schedule_downtime": scheduled, "restart_startup": restarting}
    if "lost_at_kills_island_s" in faulty and "waiting_island_s" in clean:
        shares["lost_at_kills"] = faulty["lost_at_kills_island_s"] / capacity
        available = 1.0 - scheduled - restarting  # the clean run waits this share as often
        shares["extra_waiting"] = (faulty["waiting_island_s"] - available * clean["waiting_island_s"]) / capacity
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    shares["goodput_of_available"] = goodput / (1.0 - scheduled) if scheduled < 1 else None
    return shares


def mean_restart(breakdown: list[dict]) -> dict:
    """Mean seconds per phase over a run's restarts."""
    keys = (*STARTUP_PHASES, "first_round_s", "total_s")
    return {key: sum(r[key] for r in breakdown) / len(breakdown) for key in keys} if breakdown else {}


def pair_goodputs(runs: list[dict], mode: str, *, speed_normalized: bool = False) -> list[float]:
    """Goodput of each (clean, faulty) pair of runs of `mode`: the faulty run's tokens/s over the clean run's.

    `speed_normalized`: each run's useful tokens weighed by its median step time, i.e. useful compute-seconds (a
    step is a fixed number of tokens): the ratio then counts lost time alone, not the machine running slower in
    one run of the pair (clean runs alone moved 20.9-26.7k tok/s on this shared host, inner steps 1.5-2.3 s).
    """
    by = {(r["faults"], r.get("pair", 0)): r for r in runs if r["mode"] == mode}
    pairs = sorted({pair for _, pair in by})

    def useful(run: dict) -> float:
        speed = run.get("median_step_s") if speed_normalized else 1.0
        return run["goodput_tokens_per_s"] * (speed if speed is not None else float("nan"))

    return [useful(by[(True, p)]) / max(1e-9, useful(by[(False, p)])) for p in pairs]


def summarise(runs: list[dict], islands: int, budget: float) -> dict:
    """Per mode: goodput with faults relative to without (the mean over pairs of runs), and the first faulty run's
    figures."""
    by = {(r["mode"], r["faults"]): r for r in runs if not r.get("pair")}
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    per_pair = {mode: pair_goodputs(runs, mode) for mode in modes}
    goodput = {mode: statistics.mean(values) for mode, values in per_pair.items()}
    normalized = {mode: pair_goodputs(runs, mode, speed_normalized=True) for mode in modes}
    return {
        "goodput_breakdown": {
            mode: goodput_breakdown(by[(mode, True)], by[(mode, False)], goodput[mode], islands, budget)
            for mode in modes
        },
        "restart_breakdown_mean_s": {mode: mean_restart(by[(mode, True)]["restart_breakdown"]) for mode in modes},
        "goodput": goodput,
        "goodput_pairs": per_pair,
        "goodput_speed_normalized": {mode: statistics.mean(values) for mode, values in normalized.items()},
        "goodput_speed_normalized_pairs": normalized,
        "final_eval_loss": {mode: by[(mode, True)]["final_eval_loss"] for mode in modes},
        "restart_to_first_merge_s": {mode: by[(mode, True)]["restart_to_first_merge_s"] for mode in modes},
        "restarts_killed_before_merging": {mode: by[(mode, True)]["restarts_killed_before_merging"] for mode in modes},
        "unexpected_errors": {mode: by[(mode, True)]["errors"] + by[(mode, False)]["errors"] for mode in modes},
    }


CARRIED_KEYS = (
    "goodput_breakdown",
    "restart_breakdown_mean_s",
    "goodput",
    "goodput_pairs",
    "goodput_speed_normalized",
    "goodput_speed_normalized_pairs",
    "final_eval_loss",
    "restart_to_first_merge_s",
    "restarts_killed_before_merging",
    "unexpected_errors",
)


def carry_over(result: dict, previous: Path, skipped: list[str]) -> dict:
    """The `skipped` modes' figures and runs from the `previous` result when it ran the same schedule on as many
    islands under the same CPU quotas, each mode dated in `carried_over`; the result unchanged otherwise."""
    if not skipped or not previous.exists():
        return result
    old = json.loads(previous.read_text())
    keys = ("schedule", "islands", "budget_s", "island_cpus", "cpu_quota_period_ms")
    same = json.loads(json.dumps([result.get(key) for key in keys]))
    if [old.get(key) for key in keys] != same:
        return result
    found = [mode for mode in skipped if mode in old.get("goodput", {})]
    carried = {mode: old.get("carried_over", {}).get(mode, old.get("date")) for mode in found}
    for key in CARRIED_KEYS:
        result[key] = {**result[key], **{mode: old[key][mode] for mode in found if mode in old.get(key, {})}}
    result["runs"] = result["runs"] + [run for run in old.get("runs", []) if run["mode"] in found]
    return {**result, "carried_over": carried} if carried else result


def modes_to_run(only: list[str] | None, *, extended: bool, quick: bool = False) -> tuple[str, ...]:
    """The modes a run measures, in MODES' order: `only` (--modes) if given, else QUICK_MODES with `quick`, else all
    but the extended ones unless `extended`."""
    if only:
        return tuple(mode for mode in MODES if mode in only)
    if quick:
        return tuple(mode for mode in MODES if mode in QUICK_MODES)
    return tuple(mode for mode in MODES if extended or mode not in EXTENDED_MODES)


def main(argv: list[str] | None = None) -> int:
    """Run the modes with and without the fault schedule; write chaos.json and chaos.png."""
    parser = benchmark_parser(
        __doc__,
        quick="3 islands, 22 s per run, the decoupled mode only",
        smoke="3 islands, tiny model, short runs (used by the tests)",
        extended="also the standby mode (else its figures are carried over from the last result, dated)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--island-cpus",
        type=float,
        help="CPU quota per island in cores, as on machines of their own (default: this machine's cores / islands; "
        "0: none, islands share the machine's cores)",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=tuple(MODES),
        help="run only these modes; the others' figures are carried over from the last result of the same schedule",
    )
    args = parser.parse_args(argv)
    # A SIGTERM (a stopped make bench) unwinds like Ctrl-C, so the islands' CPU cgroups are removed on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    preset = "smoke" if args.smoke else "quick" if args.quick else "full"
    islands, budget, kill_every, restart_after, stop_every, stop_for = PRESETS[preset]
    timing = dict(kill_every=kill_every, restart_after=restart_after, stop_every=stop_every, stop_for=stop_for)
    schedule = Schedule.make(seed=args.seed, islands=islands, budget=budget, **timing)
    print(f"fault schedule: {schedule.events}", flush=True)
    pairs = 1 if args.smoke or args.quick else 2
    cpus = (os.cpu_count() or 1) / islands if args.island_cpus is None else args.island_cpus
    quotas = CpuQuotas("p2p-chaos", cpus)
    print(f"CPU per island: {cpus:.2f} cores, {quotas.mode}", flush=True)
    modes = modes_to_run(args.modes, extended=args.extended or args.smoke, quick=args.quick)
    runs = run_all(schedule, islands, budget, smoke=args.smoke, out=args.out, quotas=quotas, pairs=pairs, modes=modes)
    result = {
        **provenance("chaos.py", argv),
        "islands": islands,
        "budget_s": budget,
        "schedule": {"seed": args.seed, **timing, "events": schedule.events},
        "island_cpus": cpus if quotas.active else None,
        "cpu_quota": quotas.mode,
        "cpu_quota_period_ms": quotas.period_us / 1000 if quotas.active else None,
        **summarise(runs, islands, budget),
        "runs": runs,
    }
    name = "chaos-smoke" if args.smoke else "chaos"
    result = carry_over(result, args.out / f"{name}.json", [mode for mode in MODES if mode not in modes])
    path = write_result(args.out, name, result)
    plot(result, args.out / f"{name}.png")
    print(f"goodput relative to no faults: {result['goodput']}")
    for mode, shares in result["goodput_breakdown"].items():
        print(f"  {mode}: " + ", ".join(f"{key} {value:.3f}" for key, value in shares.items() if value is not None))
    for mode, phases in result["restart_breakdown_mean_s"].items():
        print(f"  {mode} restart, mean s: " + ", ".join(f"{key} {value:.1f}" for key, value in phases.items()))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
