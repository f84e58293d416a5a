"""Decoupled DiLoCo maths against hand computations: merge weights, RDA, staleness, grace window, Delayed Nesterov."""

from __future__ import annotations

import math

import pytest
import torch

from p2p_diloco.diloco.grace import GraceWindow
from p2p_diloco.diloco.merge import (
    MergeError,
    contribution_weight,
    radial_directional_average,
    rda_decode,
    rda_encode,
    weighted_mean,
)
from p2p_diloco.diloco.outer import OuterOptimizer
from p2p_diloco.diloco.staleness import (
    StalenessRule,
    SwarmClock,
    agreeing,
    group_weights,
    implausible_claims,
    own_weight,
    robust_clock,
    stale_partners,
)


@pytest.fixture(autouse=True)
def no_leftover_daemons() -> None:
    """Overrides the conftest guard: these tests start no processes, so p2pd daemons that other test runs start
    and stop meanwhile must neither fail them nor be killed by them."""


def close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


# --- contribution_weight and weighted_mean


def test_mean_rule_weighs_every_island_one():
    assert contribution_weight("mean", 1000, 10) == 1.0
    assert contribution_weight("mean", 7, 3) == 1.0


def test_tokens_rule_is_tokens_times_tokens_per_step():
    assert contribution_weight("tokens", 1000, 10) == 100_000.0
    assert contribution_weight("tokens", 30, 4) == pytest.approx(30 * 7.5)
    # 'rda' weighs contributions like 'tokens'.
    assert contribution_weight("rda", 1000, 10) == 100_000.0


def test_tokens_rule_weight_scales_with_steps_and_with_batch_squared():
    full = contribution_weight("tokens", 1000, 10)  # 10 steps of 100 tokens
    half_steps = contribution_weight("tokens", 500, 5)  # 5 steps of the same 100-token batch
    half_batch = contribution_weight("tokens", 500, 10)  # 10 steps of a 50-token batch
    assert half_steps == pytest.approx(full / 2)
    assert half_batch == pytest.approx(full / 4)


@pytest.mark.parametrize("tokens, steps", [(0, 10), (1000, 0), (-5, 10), (1000, -1), (0, 0)])
def test_tokens_rule_rejects_non_positive_inputs(tokens, steps):
    with pytest.raises(MergeError, match="positive"):
        contribution_weight("tokens", tokens, steps)


def test_weighted_mean_with_token_weights_matches_hand_computation():
    d1 = torch.tensor([1.0, -2.0, 4.0])
    d2 = torch.tensor([3.0, 6.0, -1.0])
    d3 = torch.tensor([-5.0, 0.5, 2.0])
    w1 = contribution_weight("tokens", 1000, 10)  # 100000
    w2 = contribution_weight("tokens", 500, 5)  # 50000
    w3 = contribution_weight("tokens", 500, 10)  # 25000
    expected = (100_000 * d1 + 50_000 * d2 + 25_000 * d3) / (100_000 + 50_000 + 25_000)
    close(weighted_mean([d1, d2, d3], [w1, w2, w3]), expected)
    # Equal weights ('mean') give the plain average.
    ones = [contribution_weight("mean", t, s) for t, s in [(1000, 10), (500, 5), (500, 10)]]
    close(weighted_mean([d1, d2, d3], ones), (d1 + d2 + d3) / 3)


# --- Radial-Directional Averaging


def hand_rda(contributions: list[torch.Tensor], weights: list[float], sizes: list[int]) -> torch.Tensor:
    """Per tensor: (weighted mean of norms) * normalise(weighted mean of unit directions)."""
    total = sum(weights)
    out = []
    start = 0
    for size in sizes:
        pieces = [c[start : start + size] for c in contributions]
        norms = [p.norm() for p in pieces]
        units = [p / n if n > 0 else torch.zeros_like(p) for p, n in zip(pieces, norms)]
        mean_norm = sum(w * n for w, n in zip(weights, norms)) / total
        mean_dir = sum(w * u for w, u in zip(weights, units)) / total
        length = mean_dir.norm()
        out.append(mean_norm * mean_dir / length if length > 0 else torch.zeros(size))
        start += size
    return torch.cat(out)


def test_rda_two_contributions_over_two_tensors_matches_hand_computation():
    a = torch.tensor([3.0, 0.0, 4.0, 1.0, 0.0])  # tensor norms 5 and 1
    b = torch.tensor([0.0, 2.0, 0.0, 0.0, 3.0])  # tensor norms 2 and 3
    weights, sizes = [1.0, 3.0], [3, 2]
    # First tensor: mean norm (1*5 + 3*2)/4 = 11/4; mean direction ([.6, 0, .8] + 3*[0, 1, 0]) / 4.
    dir1 = (torch.tensor([0.6, 0.0, 0.8]) + 3 * torch.tensor([0.0, 1.0, 0.0])) / 4
    first = (11 / 4) * dir1 / dir1.norm()
    # Second tensor: mean norm (1*1 + 3*3)/4 = 10/4; mean direction ([1, 0] + 3*[0, 1]) / 4.
    dir2 = (torch.tensor([1.0, 0.0]) + 3 * torch.tensor([0.0, 1.0])) / 4
    second = (10 / 4) * dir2 / dir2.norm()
    expected = torch.cat([first, second])
    # Written out in closed form for the second tensor: 2.5 * [1, 3] / sqrt(10).
    close(second, 2.5 * torch.tensor([1.0, 3.0]) / math.sqrt(10))
    result = radial_directional_average([a, b], weights, sizes)
    close(result, expected)
    close(result, hand_rda([a, b], weights, sizes))
    # Per-tensor norms are the weighted mean norms, not the norm of the weighted mean.
    assert result[:3].norm().item() == pytest.approx(11 / 4, abs=1e-6)
    assert result[3:].norm().item() == pytest.approx(10 / 4, abs=1e-6)


def test_rda_random_contributions_match_hand_computation():
    generator = torch.Generator().manual_seed(1)
    sizes = [4, 1, 6, 3]
    contributions = [torch.randn(sum(sizes), generator=generator) for _ in range(3)]
    weights = [100_000.0, 50_000.0, 25_000.0]
    close(radial_directional_average(contributions, weights, sizes), hand_rda(contributions, weights, sizes))


def test_rda_keeps_the_norm_of_orthogonal_unit_contributions_where_the_mean_shrinks_it():
    a = torch.tensor([1.0, 0.0, 0.0, 1.0])
    b = torch.tensor([0.0, 1.0, 1.0, 0.0])
    sizes = [2, 2]
    rda = radial_directional_average([a, b], None, sizes)
    mean = weighted_mean([a, b])
    for start in (0, 2):
        assert rda[start : start + 2].norm().item() == pytest.approx(1.0, abs=1e-6)
        assert mean[start : start + 2].norm().item() == pytest.approx(1 / math.sqrt(2), abs=1e-6)
    # Same direction as the mean, only longer.
    close(rda, mean * math.sqrt(2))


def test_rda_of_identical_contributions_is_that_contribution():
    delta = torch.tensor([0.5, -1.5, 2.0, 3.0, -4.0, 0.25])
    sizes = [1, 3, 2]
    close(radial_directional_average([delta, delta.clone(), delta.clone()], [1.0, 2.0, 5.0], sizes), delta)


def test_rda_handles_a_zero_tensor_in_one_contribution():
    a = torch.tensor([3.0, 4.0, 0.0, 0.0])  # second tensor all zero
    b = torch.tensor([6.0, 8.0, 0.0, 2.0])
    sizes = [2, 2]
    result = radial_directional_average([a, b], [1.0, 1.0], sizes)
    assert torch.isfinite(result).all()
    # First tensor: same direction [.6, .8], mean norm 7.5.
    close(result[:2], torch.tensor([4.5, 6.0]))
    # Second tensor: the zero contributes norm 0 and no direction: mean norm 1, direction [0, 1].
    close(result[2:], torch.tensor([0.0, 1.0]))
    close(result, hand_rda([a, b], [1.0, 1.0], sizes))
    # Every contribution zero in a tensor gives zeros there, not NaN.
    both_zero = radial_directional_average([a, torch.tensor([1.0, 0.0, 0.0, 0.0])], None, sizes)
    assert torch.isfinite(both_zero).all()
    close(both_zero[2:], torch.zeros(2))


def test_rda_of_opposite_directions_is_zero_not_nan():
    a = torch.tensor([1.0, 2.0])
    result = radial_directional_average([a, -a], [1.0, 1.0], [2])
    assert torch.isfinite(result).all()
    close(result, torch.zeros(2))


def test_rda_encode_layout_is_directions_then_norms():
    delta = torch.tensor([3.0, 4.0, 0.0, 0.0, 0.0, 2.0])
    sizes = [2, 1, 3]
    encoded = rda_encode(delta, sizes)
    assert encoded.numel() == sum(sizes) + len(sizes)
    expected = torch.tensor([0.6, 0.8, 0.0, 0.0, 0.0, 1.0, 5.0, 0.0, 2.0])
    close(encoded, expected)


def test_weighted_mean_of_encodings_decodes_to_rda():
    """How RDA runs inside an all-reduce: peers average rda_encode vectors, each decodes the result."""
    generator = torch.Generator().manual_seed(2)
    sizes = [5, 2, 3]
    contributions = [torch.randn(sum(sizes), generator=generator) for _ in range(4)]
    contributions[1][5:7] = 0.0  # one zero tensor
    weights = [1.0, 3.0, 0.5, 2.0]
    encoded = [rda_encode(delta, sizes) for delta in contributions]
    for vector in encoded:
        assert vector.numel() == sum(sizes) + len(sizes)
    reduced = sum(w * e for w, e in zip(weights, encoded)) / sum(weights)
    decoded = rda_decode(reduced, sizes)
    close(decoded, radial_directional_average(contributions, weights, sizes))
    close(decoded, hand_rda(contributions, weights, sizes))


def test_rda_decode_rejects_a_wrong_number_of_norms():
    with pytest.raises(MergeError, match="norms"):
        rda_decode(torch.ones(6), [2, 3])


# --- StalenessRule


def test_staleness_rule_discounts_and_rejects():
    rule = StalenessRule(max_staleness=4, discount=0.5)
    assert rule.factor(0) == 1.0
    assert rule.factor(-1) == 1.0
    assert rule.factor(1) == 0.5
    assert rule.factor(2) == 0.25
    assert rule.factor(4) == 0.0625
    assert rule.factor(5) is None
    assert rule.factor(100) is None


# --- GraceWindow


def test_fixed_grace_returns_initial_clamped():
    assert GraceWindow(mode="fixed", initial_s=3.0, min_s=0.5, max_s=10.0).current() == 3.0
    assert GraceWindow(mode="fixed", initial_s=0.1, min_s=0.5, max_s=10.0).current() == 0.5
    assert GraceWindow(mode="fixed", initial_s=50.0, min_s=0.5, max_s=10.0).current() == 10.0
    fixed = GraceWindow(mode="fixed", initial_s=3.0)
    fixed.observe([9.0, 9.0], compute_s=100.0)
    assert fixed.current() == 3.0, "observations must not move a fixed window"


def test_adaptive_grace_without_observations_is_initial():
    assert GraceWindow(initial_s=2.0).current() == 2.0
    assert GraceWindow(initial_s=20.0, max_s=10.0).current() == 10.0


def test_adaptive_grace_is_high_percentile_plus_margin():
    grace = GraceWindow(initial_s=2.0, min_s=0.5, max_s=10.0, gamma=0.5, margin_s=0.25)
    delays = [0.2, 0.4, 3.0, 0.1]
    grace.observe(delays, compute_s=10.0)
    ordered = sorted(delays)
    percentile = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]  # index 3 of 4: 3.0
    assert percentile == 3.0
    assert grace.current() == pytest.approx(3.0 + 0.25)  # below the bound 0.5 * 10 = 5


def test_adaptive_grace_percentile_index_over_twenty_delays():
    grace = GraceWindow(min_s=0.0, max_s=100.0, margin_s=0.25, gamma=0.5)
    delays = [float(i) for i in range(20)]  # sorted[int(0.9 * 20)] = sorted[18] = 18.0, not the max 19.0
    grace.observe(delays[::-1], compute_s=1000.0)
    assert grace.current() == pytest.approx(18.25)


def test_adaptive_grace_bounded_by_gamma_times_compute():
    grace = GraceWindow(min_s=0.5, max_s=10.0, gamma=0.5, margin_s=0.25)
    grace.observe([0.2, 0.4, 3.0, 0.1], compute_s=2.0)
    assert grace.current() == pytest.approx(0.5 * 2.0)  # 3.25 > 1.0
    # Overlap slack extends the bound.
    assert grace.current(slack_s=1.5) == pytest.approx(0.5 * 2.0 + 1.5)
    # A tiny compute time: the bound 0.5 * 0.4 = 0.2 is clamped up to min_s.
    grace.observe([], compute_s=0.4)
    assert grace.current() == 0.5


def test_adaptive_grace_counts_negative_delays_as_zero():
    grace = GraceWindow(min_s=0.0, max_s=10.0, margin_s=0.25)
    grace.observe([-5.0, -1.0, -0.5], compute_s=10.0)
    assert list(grace.delays) == [0.0, 0.0, 0.0]
    assert grace.current() == pytest.approx(0.25)
    clamped = GraceWindow(min_s=0.5, max_s=10.0, margin_s=0.25)
    clamped.observe([-5.0], compute_s=10.0)
    assert clamped.current() == 0.5


def test_adaptive_grace_capped_by_max_s():
    grace = GraceWindow(min_s=0.5, max_s=10.0, gamma=0.5, margin_s=0.25)
    grace.observe([30.0], compute_s=100.0)  # 30.25, bound 50
    assert grace.current() == 10.0


def test_adaptive_grace_forgets_beyond_history():
    grace = GraceWindow(min_s=0.0, max_s=100.0, margin_s=0.0, history=2)
    grace.observe([9.0], compute_s=100.0)
    grace.observe([1.0, 2.0], compute_s=100.0)
    assert grace.current() == 2.0, "the 9 s delay fell out of a 2-entry history"


def test_invalid_grace_mode_raises():
    with pytest.raises(ValueError, match="adaptive"):
        GraceWindow(mode="sometimes")


# --- OuterOptimizer: Nesterov and Delayed Nesterov


@pytest.fixture
def outer_vectors() -> tuple[torch.Tensor, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    theta0 = torch.randn(9, generator=generator)
    gradients = [torch.randn(9, generator=generator) for _ in range(4)]
    return theta0, gradients


def test_momentum_every_one_is_torch_nesterov(outer_vectors):
    theta0, gradients = outer_vectors
    lr, mu = 0.7, 0.9
    outer = OuterOptimizer(theta0, lr=lr, momentum=mu, momentum_every=1)
    reference = torch.nn.Parameter(theta0.clone())
    sgd = torch.optim.SGD([reference], lr=lr, momentum=mu, nesterov=True)
    theta, m = theta0.clone(), torch.zeros(9)
    for g in gradients:
        anchor = outer.step(g).clone()
        reference.grad = g.clone()
        sgd.step()
        m = mu * m + g
        theta = theta - lr * (g + mu * m)
        assert torch.equal(anchor, reference.data)
        close(anchor, theta, atol=1e-5)
        close(outer.momentum(), m, atol=1e-5)
    assert not torch.equal(outer.anchor.data, theta0)


def test_delayed_nesterov_every_two_matches_hand_computation(outer_vectors):
    theta0, (g1, g2, g3, g4) = outer_vectors
    lr, mu = 0.5, 0.8
    outer = OuterOptimizer(theta0, lr=lr, momentum=mu, momentum_every=2)

    # Step 1: momentum still zero; it is not updated (1 of 2 buffered).
    m1 = torch.zeros(9)
    theta1 = theta0 - lr * (g1 + mu * m1)
    # Step 2: momentum absorbs the mean of g1, g2 first, then the step uses the new momentum.
    m2 = mu * m1 + (g1 + g2) / 2
    theta2 = theta1 - lr * (g2 + mu * m2)
    # Step 3: buffered only; look-ahead with m2.
    m3 = m2
    theta3 = theta2 - lr * (g3 + mu * m3)
    # Step 4: momentum absorbs the mean of g3, g4.
    m4 = mu * m3 + (g3 + g4) / 2
    theta4 = theta3 - lr * (g4 + mu * m4)

    for g, theta, m in [(g1, theta1, m1), (g2, theta2, m2), (g3, theta3, m3), (g4, theta4, m4)]:
        returned = outer.step(g)
        close(returned, theta, atol=1e-5)
        close(outer.anchor.data, theta, atol=1e-5)
        close(outer.momentum(), m, atol=1e-5)
    assert outer.pending is None and outer.pending_count == 0


def test_delayed_nesterov_differs_from_plain_nesterov(outer_vectors):
    theta0, gradients = outer_vectors
    plain = OuterOptimizer(theta0, momentum_every=1)
    delayed = OuterOptimizer(theta0, momentum_every=2)
    for g in gradients[:2]:
        plain.step(g)
        delayed.step(g)
    assert not torch.allclose(plain.anchor.data, delayed.anchor.data, atol=1e-4)
    assert not torch.allclose(plain.momentum(), delayed.momentum(), atol=1e-4)


def test_delayed_nesterov_with_three_buffers_averages_them(outer_vectors):
    theta0, (g1, g2, g3, _) = outer_vectors
    lr, mu = 0.7, 0.9
    outer = OuterOptimizer(theta0, lr=lr, momentum=mu, momentum_every=3)
    outer.step(g1)
    outer.step(g2)
    close(outer.momentum(), torch.zeros(9))
    close(outer.pending, g1 + g2)
    assert outer.pending_count == 2
    theta2 = theta0 - lr * g1 - lr * g2
    close(outer.anchor.data, theta2, atol=1e-5)
    outer.step(g3)
    m = (g1 + g2 + g3) / 3
    close(outer.momentum(), m, atol=1e-6)
    close(outer.anchor.data, theta2 - lr * (g3 + mu * m), atol=1e-5)


@pytest.mark.parametrize("every", [0, -1])
def test_momentum_every_below_one_raises(every):
    with pytest.raises(ValueError, match="momentum_every"):
        OuterOptimizer(torch.zeros(3), momentum_every=every)


def test_grace_window_backs_off_when_partners_are_missed_and_recovers_after_a_merge() -> None:
    window = GraceWindow(mode="adaptive", initial_s=2.0, min_s=1.0, max_s=10.0, gamma=0.5)
    assert window.current() == 2.0
    window.observe([], compute_s=1.0, missed=True)
    assert window.current() == 2.0  # min_s * 2
    window.observe([], compute_s=1.0, missed=True)
    window.observe([], compute_s=1.0, missed=True)
    assert window.current() == 8.0
    window.observe([], compute_s=1.0, missed=True)
    assert window.current() == 10.0  # capped by max_s
    window.observe([0.1], compute_s=1.0)
    assert window.current() == 5.0  # halves back after a merge


def test_dynamic_local_updates_give_slower_islands_fewer_inner_steps() -> None:
    from p2p_diloco.config import load_config
    from p2p_diloco.island.island import Island

    island = Island(load_config(overrides={"train.inner_steps": 60, "train.dynamic_steps": True}))

    def planned() -> int:  # what Island._round plans from the swarm's announced step times
        return island.trainer.planned_steps([info.get("step_time_s") for info in island.swarm_view.values()])

    assert planned() == 60  # no step time measured yet
    island.trainer.step_time_s = 0.3
    island.swarm_view = {"fast": {"step_time_s": 0.1}, "same": {"step_time_s": 0.3}, "unknown": {"step_time_s": None}}
    assert planned() == 20  # floor(0.1 / 0.3 * 60)
    island.trainer.step_time_s = 0.1
    assert planned() == 60  # the fastest island runs the full H
    island.config.train.dynamic_steps = False
    island.trainer.step_time_s = 0.3
    assert planned() == 60


def test_group_weights_use_a_robust_clock_and_cap_declared_weights():
    rule = StalenessRule(max_staleness=2, discount=0.5)
    members = {
        "fresh": {"outer_step": 7, "swarm_step": 7, "base_weight": 2.0},
        "behind": {"outer_step": 6, "swarm_step": 6, "base_weight": 4.0},
        "slept": {"outer_step": 3, "swarm_step": 3, "base_weight": 1.0},  # its own view said it was current
        "knows": {"outer_step": 7, "swarm_step": 8, "base_weight": 1.0},  # the DHT told it of step 8
    }
    # clock: the 2nd highest claim of 4 (8, 7, 6, 3) = 7; cap: 2 x the lower median base weight (1.0) = 2.0
    assert group_weights(members, rule) == {"fresh": 2.0, "behind": 1.0, "slept": 0.0, "knows": 1.0}
    liar = {**members, "liar": {"outer_step": 7, "swarm_step": 10**6, "base_weight": 1e12}}
    assert group_weights(liar, rule)["liar"] == 4.0 and group_weights(liar, rule)["fresh"] == 2.0  # 2 x median


def test_robust_clock_needs_more_than_one_island_to_move():
    assert robust_clock([]) == 0 and robust_clock([5]) == 5
    assert robust_clock([10**9, 8]) == 8 and robust_clock([10**9, 8, 8]) == 8 and robust_clock([10**9, 9, 8, 7]) == 9
    assert [agreeing(n) for n in range(1, 9)] == [1, 2, 2, 2, 3, 3, 3, 4]


def test_an_island_that_slept_drops_itself_but_an_impossible_claim_is_ignored():
    rule = StalenessRule(max_staleness=2, discount=0.5)
    now = 1000.0
    slept = {"outer_step": 3, "swarm_step": 3, "base_weight": 1.0, "ready": now - 60, "round_s": 2.0}
    fresh = {"outer_step": 9, "swarm_step": 9, "base_weight": 1.0, "ready": now, "round_s": 2.0}
    assert own_weight("slept", {"slept": slept, "fresh": fresh}, rule, now) == 0.0  # 60 s asleep: 9 is plausible
    awake = {**slept, "ready": now}
    liar = {**fresh, "swarm_step": 10**6}
    assert own_weight("awake", {"awake": awake, "liar": liar}, rule, now) == 1.0  # 10**6 in no time is not
    clock = SwarmClock()
    assert clock.update(0, {"a": 57}, now, 2.0) == 57  # a newcomer believes the first view it gets
    assert clock.update(57, {"liar": 10**9, "a": 58}, now + 2, 2.0) == 58  # then an impossible jump is ignored
    assert clock.implausible == {"liar": 10**9}
    alone = SwarmClock()  # joined while the DHT showed nobody: its own steps are no view of the swarm
    assert alone.update(0, {}, now, 0.2) == 0 and alone.update(1, {}, now + 0.2, 0.2) == 1
    assert alone.update(2, {"a": 51, "b": 51}, now + 0.4, 0.2) == 51 and alone.implausible == {}
    assert alone.update(3, {"a": 52, "b": 10**9}, now + 0.6, 0.2) == 52  # from then on, bounded as before


def test_a_woken_island_whose_first_look_is_stale_still_believes_the_swarm_ahead():
    # Frozen two minutes at step 2; the first look after waking reads records as old as itself (a replica's local
    # storage that missed stores): no news. The next look shows the swarm 7 ahead, reached during the freeze.
    clock, now = SwarmClock(), 1000.0
    for step in (1, 2):
        now += 0.5
        clock.update(step, {"a": step, "b": step}, now, 0.5)
    now += 120
    assert clock.update(3, {"a": 2, "b": 2}, now, 120.5) == 3
    assert clock.update(4, {"a": 10, "b": 11}, now + 0.5, 0.5) == 10 and clock.implausible == {}
    # News again: from then on an impossible jump is ignored as before.
    assert clock.update(5, {"a": 11, "b": 11, "liar": 10**6}, now + 1.0, 0.5) == 11
    assert clock.implausible == {"liar": 10**6}


def test_a_leader_hearing_of_a_swarm_behind_it_keeps_the_bound_current():
    clock, now = SwarmClock(), 1000.0
    clock.update(5, {"a": 5, "b": 5}, now, 0.5)
    for step in range(6, 12):  # the others' claims rise behind the leader's step: each is news
        now += 0.5
        clock.update(step, {"a": step - 2, "b": step - 2}, now, 0.5)
    assert clock.update(12, {"a": 10, "b": 10**3, "c": 10**3}, now + 0.5, 0.5) == 12  # two liars agreeing: too far
    assert clock.implausible == {"b": 10**3, "c": 10**3}


def test_only_an_island_with_a_view_of_the_swarm_names_an_impossible_claim():
    now = 1000.0
    member = {"outer_step": 9, "swarm_step": 9, "base_weight": 1.0, "ready": now, "round_s": 2.0}
    honest, liar = {**member, "outer_step": 10, "swarm_step": 10}, {**member, "swarm_step": 10**6}
    assert implausible_claims("me", {"me": member, "honest": honest, "liar": liar}, now) == {"liar": 10**6}
    # Started fresh and found no records (a restarted bootstrap): a lead of 52 steps may well be true.
    newcomer = {**member, "outer_step": 0, "swarm_step": 0}
    assert implausible_claims("me", {"me": newcomer, "honest": {**member, "outer_step": 52}}, now) == {}
    assert own_weight("me", {"me": newcomer, "liar": liar}, StalenessRule(3, 0.5), now) == 1.0  # ignored all the same


def test_a_fresh_island_names_a_partner_its_own_step_shows_too_stale_where_a_pair_weighs_it_in_full():
    rule = StalenessRule(max_staleness=3, discount=0.5)
    woken = {"outer_step": 3, "swarm_step": 3, "base_weight": 1.0}  # frozen at 3, its view too young to doubt
    fresh = {"outer_step": 9, "swarm_step": 9, "base_weight": 1.0}
    pair = {"woken": woken, "fresh": fresh}

    def stale(me: str, members: dict) -> dict:
        return stale_partners(me, members, group_weights(members, rule), rule)

    assert group_weights(pair, rule) == {"woken": 1.0, "fresh": 1.0}  # two claims: the clock is the lower one
    assert stale("fresh", pair) == {"woken": 6}
    assert stale("woken", pair) == {}  # a partner ahead is never "stale"
    within = {"behind": {**woken, "outer_step": 6, "swarm_step": 6}, "fresh": fresh}
    assert stale("fresh", within) == {}  # 3 behind: within --max-staleness
    trio = {**pair, "other": {**fresh, "outer_step": 8, "swarm_step": 8}}
    assert group_weights(trio, rule)["woken"] == 0.0 and stale("fresh", trio) == {}  # outvoted


def test_a_round_stretched_by_a_freeze_does_not_slow_the_clock_it_judges_the_swarm_by():
    # Rounds of 0.3 s, then one frozen for 6 s: the swarm ran on at its pace meanwhile (20 steps in 6 s is 4x
    # slower than the island's own pace, so plausible). Judged by the frozen round alone it would be 4x too fast.
    clock = SwarmClock()
    now = 1000.0
    for step in range(1, 7):
        now += 0.3
        clock.update(step, {"a": step, "b": step}, now, 0.3)
    now += 6.0
    assert clock.update(7, {"a": 26, "b": 26}, now, 6.0) == 26
    assert clock.pace_s == 0.3
    assert clock.update(26, {"liar": 10**6, "a": 27, "b": 27}, now + 0.3, 0.3) == 27  # a lie is still ignored
