"""The chaos benchmark's smoke mode runs end to end, so the benchmark cannot silently rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from benchmarks_path import BENCHMARKS
from chaos import Schedule, schedule_downtime  # noqa: E402
from lib.cpu_quota import CpuQuotas  # noqa: E402


def test_schedule_is_seeded_and_never_hits_a_down_island() -> None:
    first = Schedule.make(seed=3, islands=4, budget=100, kill_every=20, restart_after=8, stop_every=25, stop_for=6)
    again = Schedule.make(seed=3, islands=4, budget=100, kill_every=20, restart_after=8, stop_every=25, stop_for=6)
    assert first.events == again.events and any(action == "kill" for _, action, _ in first.events)
    down: dict[int, str] = {}
    for _, action, island in first.events:
        if action in ("kill", "stop"):
            assert island not in down, f"island {island} hit while already {down[island]}"
            down[island] = action
        else:
            down.pop(island)


def test_an_island_runs_under_its_cpu_quota_and_the_group_goes_with_the_run() -> None:
    assert CpuQuotas("p2p-test", 0).prefix(0) == [] and CpuQuotas("p2p-test", None).mode.startswith("none")
    quotas = CpuQuotas("p2p-test", 0.25)
    if not quotas.active:  # islands then run unconstrained, and the JSON says why
        pytest.skip(f"no CPU quotas here: {quotas.mode}")
    try:
        shown = subprocess.run([*quotas.prefix(1), "cat", "/proc/self/cgroup"], capture_output=True, text=True)
        group = quotas.groups[1]
        assert shown.returncode == 0 and group.name in shown.stdout, shown
        if "v1" in quotas.mode:
            written = [(group / name).read_text().strip() for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us")]
        else:
            written = (group / "cpu.max").read_text().split()
        assert written == [str(quotas.period_us // 4), str(quotas.period_us)] and quotas.period_us == 10_000
    finally:
        quotas.close()
    assert not group.exists()


def test_downtime_counts_killed_and_frozen_island_seconds() -> None:
    schedule = Schedule([(10.0, "kill", 0), (12.0, "stop", 1), (14.0, "restart", 0), (15.0, "cont", 1)])
    assert schedule_downtime(schedule) == 4.0 + 3.0
    assert schedule_downtime(schedule, kills=False) == 3.0  # a standby takes over at the kill
    assert schedule_downtime(None) == 0.0


def test_chaos_smoke(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "chaos.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "chaos-smoke.json").read_text())
    assert set(data["goodput"]) == {"decoupled", "synchronous", "standby"}
    assert all(value > 0 for value in data["goodput"].values())
    assert data["unexpected_errors"]["decoupled"] == data["unexpected_errors"]["standby"] == [], data
    # Each killed island's standby took over and merged, counted from the kill.
    standby = next(run for run in data["runs"] if run["mode"] == "standby" and run["faults"])
    assert standby["kills"] > 0 and len(standby["restart_breakdown"]) == standby["kills"], standby
    assert any(run["kills"] > 0 for run in data["runs"])
    shares = data["goodput_breakdown"]["decoupled"]
    assert shares["goodput"] == data["goodput"]["decoupled"] and 0 < shares["schedule_downtime"] < 1
    restarts = [r for run in data["runs"] for r in run["restart_breakdown"]]
    assert restarts, data["runs"]  # every restart that merged names its start-up phases
    for restart in restarts:
        assert restart["process_start_s"] > 0 and restart["join_s"] > 0 and restart["restore_s"] >= 0, restart
        assert restart["total_s"] >= restart["process_start_s"] + restart["join_s"], restart


def test_a_restart_killed_before_merging_has_no_breakdown() -> None:
    from chaos import Faults, restart_breakdown

    startup = {"process_start_s": 5.0, "join_s": 2.0, "restore_s": 1.0}
    records = {3: [{"time": 130.0, "partners": 2, **startup}]}  # the second incarnation's first merged round
    faults = Faults(kills=2, kill_times=[(3, 30.0), (3, 60.0)], restarts=[(3, 40.0), (3, 110.0)])
    [only] = restart_breakdown(records, faults)
    assert only["total_s"] == 20.0 and only["first_round_s"] == 12.0


def test_a_kill_loses_the_training_since_the_incarnations_last_round() -> None:
    from chaos import Faults, lost_at_kills_island_s, waiting_island_s

    records = {0: [{"time": 105.0, "wait_s": 1.5}, {"time": 112.0, "wait_s": 0.5}, {"time": 150.0, "wait_s": 2.0}]}
    # Killed at 120 (last round 112), restarted at 130, killed again at 140 before it recorded a round.
    faults = Faults(kills=2, kill_times=[(0, 120.0), (0, 140.0)], restarts=[(0, 130.0)])
    assert lost_at_kills_island_s(records, faults, started_wall=100.0) == 8.0 + 10.0
    assert waiting_island_s(records) == 4.0


def test_a_round_stepped_alone_and_dropped_by_the_next_resync_is_not_useful() -> None:
    from chaos import dropped_solo_rounds, useful_tokens

    rounds = [(100, 2, False), (200, 0, False), (300, 3, True), (400, 0, False), (500, 2, False)]
    records = {0: [{"tokens": t, "partners": p, "resynced": r, "time": 1.0} for t, p, r in rounds]}
    # The second round stepped alone and the third realigned to the swarm: its 100 tokens never reached the model.
    # The fourth stepped alone too, but the fifth merged without a resync: its step stood.
    assert useful_tokens(records) == 400 and dropped_solo_rounds(records) == 1


def test_speed_normalized_goodput_weighs_each_run_by_its_step_time() -> None:
    from chaos import pair_goodputs

    # The faulty run trained 3/4 of the clean run's tokens, but on a host running its steps 4/3 as slow: it lost
    # no time to faults; the token ratio alone says 0.75.
    clean = {"mode": "decoupled", "faults": False, "pair": 0, "goodput_tokens_per_s": 400.0, "median_step_s": 0.3}
    faulty = {"mode": "decoupled", "faults": True, "pair": 0, "goodput_tokens_per_s": 300.0, "median_step_s": 0.4}
    assert pair_goodputs([clean, faulty], "decoupled") == [0.75]
    assert pair_goodputs([clean, faulty], "decoupled", speed_normalized=True) == [pytest.approx(1.0)]


def test_a_plain_run_carries_the_standby_figures_over_dated_and_only_from_the_same_schedule(tmp_path: Path) -> None:
    from chaos import CARRIED_KEYS, carry_over

    schedule = {"seed": 0, "events": [[30.0, "kill", 3]]}
    figures = {key: {"standby": f"{key} of standby"} for key in CARRIED_KEYS}
    old = {"date": "2026-12-05T04:04:39", "schedule": schedule, "islands": 5, "budget_s": 90.0, **figures}
    old["runs"] = [{"mode": "standby", "faults": True}, {"mode": "decoupled", "faults": True}]
    previous = tmp_path / "chaos.json"
    previous.write_text(json.dumps(old))
    new = {key: {"decoupled": 1.0} for key in CARRIED_KEYS}
    new.update(schedule={"seed": 0, "events": [(30.0, "kill", 3)]}, islands=5, budget_s=90.0)
    new["runs"] = [{"mode": "decoupled", "faults": False}]
    merged = carry_over(dict(new), previous, ["standby"])
    assert merged["carried_over"] == {"standby": "2026-12-05T04:04:39"}
    assert merged["goodput"] == {"decoupled": 1.0, "standby": "goodput of standby"}
    assert [run["mode"] for run in merged["runs"]] == ["decoupled", "standby"]
    # Carried twice, the figures keep the date they were measured on.
    previous.write_text(json.dumps({**merged, "date": "2026-12-06T00:00:00"}))
    assert carry_over(dict(new), previous, ["standby"])["carried_over"] == {"standby": "2026-12-05T04:04:39"}
    # Another schedule or CPU quota, or nothing skipped: nothing is carried.
    assert "carried_over" not in carry_over({**new, "islands": 3}, previous, ["standby"])
    assert "carried_over" not in carry_over({**new, "cpu_quota_period_ms": 10.0}, previous, ["standby"])
    assert "carried_over" not in carry_over(dict(new), previous, [])


def test_modes_picks_the_modes_a_run_measures_and_the_rest_are_carried_over(tmp_path: Path) -> None:
    from chaos import CARRIED_KEYS, MODES, carry_over, modes_to_run

    assert modes_to_run(None, extended=False) == ("decoupled", "synchronous")
    assert modes_to_run(None, extended=True) == tuple(MODES)
    assert modes_to_run(None, extended=False, quick=True) == ("decoupled",)
    assert modes_to_run(["synchronous"], extended=False, quick=True) == ("synchronous",)
    assert modes_to_run(["standby", "decoupled"], extended=False) == ("decoupled", "standby")
    schedule = {"seed": 0, "events": [[30.0, "kill", 3]]}
    figures = {key: {mode: f"{key} of {mode}" for mode in MODES} for key in CARRIED_KEYS}
    old = {"date": "2026-12-05T04:04:39", "schedule": schedule, "islands": 5, "budget_s": 90.0, **figures}
    old["runs"] = [{"mode": mode, "faults": True} for mode in MODES]
    previous = tmp_path / "chaos.json"
    previous.write_text(json.dumps(old))
    new = {key: {"standby": 0.9} for key in CARRIED_KEYS}
    new.update(schedule=schedule, islands=5, budget_s=90.0, runs=[{"mode": "standby", "faults": True}])
    skipped = [mode for mode in MODES if mode not in modes_to_run(["standby"], extended=False)]
    merged = carry_over(new, previous, skipped)
    assert merged["goodput"] == {
        "standby": 0.9,
        "decoupled": "goodput of decoupled",
        "synchronous": "goodput of synchronous",
    }
    assert merged["carried_over"] == {"decoupled": old["date"], "synchronous": old["date"]}


def test_a_quick_run_writes_beside_the_committed_results_not_over_them() -> None:
    from lib.common import QUICK_RESULTS, RESULTS, benchmark_parser

    parser = benchmark_parser(None, quick="fewer steps")
    assert parser.parse_args([]).out == RESULTS
    assert parser.parse_args(["--quick"]).out == QUICK_RESULTS != RESULTS
    assert parser.parse_args(["--quick", "--out", "elsewhere"]).out == Path("elsewhere")
    assert parser.parse_args(["--smoke", "--out", "elsewhere"]).out == Path("elsewhere")
