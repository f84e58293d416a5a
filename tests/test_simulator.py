"""The goodput simulator (benchmarks/simulator.py): limits, trends, determinism and its output files."""

from __future__ import annotations

import json
from dataclasses import replace

import benchmarks_path  # noqa: F401
import pytest
import simulator as sim

SHORT = sim.Params(days=1.0)


@pytest.mark.parametrize(
    "method, islands",
    [("data_parallel", 1), ("elastic_data_parallel", 1), ("p2p_diloco", 1), ("p2p_diloco", 4), ("p2p_diloco", 16)],
)
def test_no_failures_means_full_goodput(method, islands):
    params = replace(SHORT, failures_per_chip_year=0.0)
    row = sim.simulate(method, 1_200_000, islands, params, seed=3)
    assert row["goodput"] == pytest.approx(1.0, abs=1e-9)
    assert row.get("failures", 0) == 0


def test_sync_that_does_not_fit_its_overlap_window_costs_goodput():
    params = replace(SHORT, failures_per_chip_year=0.0, bandwidth_gbps=1.0)  # 2 (3/4) 20 GB / 1 Gbit/s = 240 s
    row = sim.simulate("p2p_diloco", 150_000, 4, params)
    stall = params.sync_stall_s(4)
    assert stall > 0
    assert row["goodput"] < 1.0
    assert row["sync_stall_fraction"] == pytest.approx(stall / (params.round_s + stall), rel=0.02)


def test_data_parallel_falls_with_chips_and_matches_renewal_theory():
    rows = [sim.simulate("data_parallel", chips, 1, SHORT) for chips in (150_000, 600_000, 2_400_000)]
    goodputs = [row["goodput"] for row in rows]
    assert goodputs[0] > goodputs[1] > goodputs[2]
    for row in rows:
        assert row["goodput"] == pytest.approx(row["analytic_goodput"], abs=0.03)


def test_islands_degrade_less_than_data_parallel_at_the_largest_scale():
    chips = 2_400_000
    dp = sim.simulate("data_parallel", chips, 1, SHORT)["goodput"]
    elastic = sim.simulate("elastic_data_parallel", chips, 1, SHORT)["goodput"]
    p2p = {m: sim.simulate("p2p_diloco", chips, m, SHORT)["goodput"] for m in (1, 4, 16)}
    assert p2p[1] == pytest.approx(dp, abs=0.03)  # one island is one failure domain, like data-parallel
    assert dp < p2p[4] < p2p[16]
    assert p2p[16] > elastic > dp


def test_staleness_rule_and_merge_weights_are_applied():
    row = sim.simulate("p2p_diloco", 1_200_000, 16, SHORT)
    assert row["stale_contributions"] > 0
    assert row["goodput"] < row["goodput_undiscounted"]  # stale tokens count at discount**staleness
    no_discount = sim.simulate("p2p_diloco", 1_200_000, 16, replace(SHORT, discount=1.0))
    assert no_discount["goodput"] == pytest.approx(no_discount["goodput_undiscounted"], abs=1e-12)
    strict = sim.simulate("p2p_diloco", 1_200_000, 16, replace(SHORT, max_staleness=0))
    assert strict["rejected"] > 0 and strict["stale_contributions"] == 0
    assert 0 < row["merged_inner_steps"] <= 2 * SHORT.inner_steps


def test_deterministic_given_a_seed():
    for method, islands in (("data_parallel", 1), ("elastic_data_parallel", 1), ("p2p_diloco", 8)):
        first = sim.simulate(method, 600_000, islands, SHORT, seed=7)
        again = sim.simulate(method, 600_000, islands, SHORT, seed=7)
        other = sim.simulate(method, 600_000, islands, SHORT, seed=8)
        assert first == again
        assert first["goodput"] != other["goodput"]


def test_parse_counts():
    assert sim.parse_list("150k,1.2M,2400000") == [150_000, 1_200_000, 2_400_000]


def test_quick_main_writes_json_and_plot(tmp_path):
    assert sim.main(["--quick", "--days", "0.25", "--out", tmp_path]) == 0
    result = json.loads((tmp_path / "simulator-quick.json").read_text())
    assert {"command", "date", "machine", "rows", "paper", "notes"} <= set(result)
    assert result["rows"]
    for row in result["rows"]:
        assert {"chips", "method", "islands", "goodput"} <= set(row)
        assert 0.0 <= row["goodput"] <= 1.0
    assert {row["method"] for row in result["rows"]} == {"data_parallel", "elastic_data_parallel", "p2p_diloco"}
    assert result["paper"]["goodput"] == {"p2p_diloco": 0.88, "data_parallel": 0.27}
    comparison = result["paper_comparison"]
    assert len(comparison) == 8 and {row["chips"] for row in comparison} == {1_200_000, 2_400_000}
    assert all({"chips", "system", "islands", "ours", "paper"} <= set(row) for row in comparison)
    assert result["paper_comparison_setting"]["assumptions_that_differ"]
    assert (tmp_path / "simulator-quick.png").stat().st_size > 0


def test_elastic_learners_lose_less_than_whole_island_restarts():
    from dataclasses import replace

    from lib.simulation_paper import simulate_elastic_learners

    p = replace(sim.Params(), days=0.5)
    elastic = simulate_elastic_learners(1_200_000, 8, p)["goodput"]
    restarts = sim.simulate("p2p_diloco", 1_200_000, 8, p)["goodput"]
    assert restarts < elastic < 1.0  # a learner never goes fully down, never rolls back, is never stale


def test_recovery_modes():
    pull = sim.simulate("p2p_diloco", 1_200_000, 8, SHORT)
    assert pull["pulls"] > 0.5 * pull["failures"]  # almost every restart pulls from a healthy peer
    resume = sim.simulate("p2p_diloco", 1_200_000, 8, replace(SHORT, recovery="checkpoint"))
    assert resume["pulls"] == resume["rejected"]  # pulls only when the staleness rule rejects
    alone = sim.simulate("p2p_diloco", 1_200_000, 1, SHORT)
    assert alone["pulls"] == 0 and alone["stale_contributions"] == 0  # M = 1: no peer, no staleness
