"""Sparse pseudo-gradients: top-k selection, the wire format, exact merges of different positions, a swarm."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch
from conftest import LocalSwarm

from p2p_diloco.diloco.error_feedback import ErrorFeedback
from p2p_diloco.diloco.fragments import Fragment
from p2p_diloco.diloco.merge import sparse_mean
from p2p_diloco.diloco.quantize import CodecMismatchError, quantizer
from p2p_diloco.diloco.sparse import CHUNK, decode_sparse, encode_sparse, topk_sparsify
from p2p_diloco.diloco.staleness import StalenessRule
from p2p_diloco.island.contribution import Contribution
from p2p_diloco.net.exchange import ExchangeResult


def gaussian(size: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(seed))


def test_topk_keeps_the_largest_values_of_every_chunk() -> None:
    values = gaussian(3 * CHUNK + 100)
    sparse = topk_sparsify(values, 0.02)
    keep = math.ceil(0.02 * CHUNK)
    for start in range(0, 3 * CHUNK, CHUNK):
        chunk, kept = values[start : start + CHUNK], sparse[start : start + CHUNK]
        assert int((kept != 0).sum()) == keep
        threshold = chunk.abs().topk(keep).values.min()
        assert torch.equal(kept != 0, chunk.abs() >= threshold)
        assert torch.equal(kept[kept != 0], chunk[kept != 0])  # kept values are untouched
    assert int((sparse[3 * CHUNK :] != 0).sum()) == keep  # a short last chunk has the same budget


def test_a_nan_is_always_selected() -> None:
    values = gaussian(CHUNK)
    values[17] = float("nan")
    assert torch.isnan(topk_sparsify(values, 0.001)[17])


@pytest.mark.parametrize(("bits", "bound"), [(2, 0.2), (4, 0.05)])
def test_the_wire_keeps_every_position_and_values_within_their_bits(bits: int, bound: float) -> None:
    sparse = topk_sparsify(gaussian(100_003), 0.02)
    decoded = decode_sparse(encode_sparse(sparse, bits), sparse.numel())
    assert torch.equal(decoded != 0, sparse != 0)
    assert torch.equal(decoded.sign(), sparse.sign())
    assert float((decoded - sparse).norm() / sparse.norm()) < bound
    bits_per_nonzero = 8 * len(encode_sparse(sparse, bits)) / int((sparse != 0).sum())
    assert bits_per_nonzero < 7 + bits + 1.0  # a Rice-coded gap (about 7.5 bits at 2%), block ranges, header
    print(f"{bits}-bit values: {bits_per_nonzero:.2f} bits per nonzero")


def test_contributions_with_different_positions_merge_exactly() -> None:
    """A reducer's weighted mean of decoded sparse parts goes back with the union of their positions."""
    parts = [topk_sparsify(gaussian(20_000, seed), 0.02) for seed in (1, 2, 3)]
    decoded = [decode_sparse(encode_sparse(part, 4), part.numel()) for part in parts]
    weights = torch.tensor([1.0, 2.0, 0.5])
    merged = sum(w * d for w, d in zip(weights, decoded)) / weights.sum()
    back = decode_sparse(encode_sparse(merged, 4), merged.numel())
    union = torch.stack([part != 0 for part in parts]).any(dim=0)
    assert torch.equal(back != 0, union)  # every position of every contribution survives the return trip
    assert int(union.sum()) > 2.5 * int((parts[0] != 0).sum())  # their positions really differ
    # 4-bit magnitudes of the merge: its range is wider than one contribution's (weights, overlaps)
    assert float((back - merged).norm() / merged.norm()) < 0.1


def test_a_sparse_reducer_averages_each_value_over_the_islands_that_sent_it() -> None:
    """A value the heaviest island chose alone arrives whole, not divided by the group's size; one a lighter island
    chose alone keeps its weight relative to the heaviest (a stale island's discount); NaN still poisons."""
    from p2p_diloco.net.reducers import SparsePartReducer, make_reducer

    contributions = [
        torch.tensor([1.0, 0.0, 2.0, 0.0, 6.0]),
        torch.tensor([3.0, 4.0, 0.0, 0.0, 0.0]),
        torch.tensor([0.0, 0.0, 0.0, 0.0, float("nan")]),
    ]
    weights = [1.0, 3.0, 2.0]

    async def scenario() -> torch.Tensor:
        reducer = make_reducer("none", [torch.Size([5])], [math.inf] * 3, None, sparse=True)
        assert isinstance(reducer, SparsePartReducer)
        tasks = [
            reducer.accumulate_part(i, 0, part, weight=w) for i, (part, w) in enumerate(zip(contributions, weights))
        ]
        return (await asyncio.gather(*tasks))[0].clone()

    expected = torch.tensor([(1.0 + 9.0) / 4.0, 4.0, 2.0 / 3.0, 0.0, float("nan")])
    torch.testing.assert_close(asyncio.run(scenario()), expected, equal_nan=True)
    torch.testing.assert_close(sparse_mean(contributions, weights), expected, equal_nan=True)


def test_centered_clip_of_topk_contributions_keeps_the_scale_of_the_values_sent() -> None:
    """Public swarms merge with CenteredClip: over sparse parts it would shrink values few islands chose, as a plain
    mean does, unless scaled to their senders; the median keeps counting absent values as zeros."""
    from p2p_diloco.net.reducers import make_reducer

    shared = gaussian(8192, seed=10)
    parts = [topk_sparsify(shared + 0.7 * gaussian(8192, seed=20 + i), 0.05) for i in range(4)]

    def merge(rule: str, sparse: bool) -> torch.Tensor:
        async def scenario() -> torch.Tensor:
            reducer = make_reducer(rule, [torch.Size([8192])], [math.inf] * 4, None, sparse=sparse)
            tasks = [reducer.accumulate_part(i, 0, part, weight=1.0) for i, part in enumerate(parts)]
            return (await asyncio.gather(*tasks))[0].clone()

        return asyncio.run(scenario())

    exact = sparse_mean(parts)
    scaled, shrunk = merge("clip", sparse=True), merge("clip", sparse=False)
    assert torch.equal(scaled != 0, exact != 0)
    assert float((scaled - exact).norm() / exact.norm()) < 0.05
    assert float((shrunk - exact).norm() / exact.norm()) > 0.4
    assert torch.equal(merge("median", sparse=True), merge("median", sparse=False))


def test_a_faded_residual_keeps_that_share_of_what_was_left_out() -> None:
    feedback = ErrorFeedback(decay=0.5)
    compensated = feedback.compensate(torch.tensor([4.0, 1.0]))
    feedback.update(torch.tensor([4.0, 0.0]), compensated)
    torch.testing.assert_close(feedback.compensate(torch.tensor([1.0, 1.0])), torch.tensor([1.0, 1.5]))
    with pytest.raises(ValueError, match="decay"):
        ErrorFeedback(decay=1.5)


def test_a_postponed_round_gives_the_residual_back_to_error_feedback() -> None:
    # A donor that postpones a step alone keeps this round's progress in its weights; what top-k left out of earlier
    # rounds (98% of each) lives only in the residual, which the own update's verdict had cleared.
    feedback = ErrorFeedback()
    feedback.residual = torch.tensor([0.5, -0.25, 0.0, 0.125])
    left_out = feedback.residual
    whole = Fragment(number=0, count=1, index=slice(None), tensor_sizes=(4,), size=4)
    metadata = {"outer_step": 0, "swarm_step": 0, "base_weight": 1.0}
    contribution = Contribution(
        torch.ones(4), whole, metadata, peer_id="me", merge_rule="tokens", codec="topk",
        staleness_rule=StalenessRule(), feedback=feedback, topk_density=0.25,
    )  # fmt: skip
    verdict = contribution.judge(ExchangeResult(merged=None, error="no partner within the window"))
    assert not verdict.merged and feedback.residual is None  # applied alone, nothing would be left out
    contribution.postpone()
    assert torch.equal(feedback.residual, left_out)


def test_error_feedback_sends_everything_eventually() -> None:
    """With feedback, the sum of what was sent trails the sum of the deltas by exactly the current residual."""
    feedback, codec = ErrorFeedback(), quantizer("topk")
    total_delta, total_sent = torch.zeros(8192), torch.zeros(8192)
    for round_number in range(30):
        delta = gaussian(8192, seed=round_number)
        compensated = feedback.compensate(delta)
        sent = codec.round_trip(topk_sparsify(compensated, 0.02))
        feedback.update(sent, compensated)
        total_delta += delta
        total_sent += sent
    assert torch.allclose(total_sent + feedback.residual, total_delta, atol=1e-3)
    without = sum(topk_sparsify(gaussian(8192, seed=r), 0.02) for r in range(30))
    error_with = float((total_sent - total_delta).norm() / total_delta.norm())
    error_without = float((without - total_delta).norm() / total_delta.norm())
    assert error_with < 0.8 * error_without, (error_with, error_without)


@pytest.mark.parametrize("damage", ["truncated", "count", "position", "rice", "unary", "gap"])
def test_a_malformed_sparse_payload_is_a_codec_mismatch(damage: str) -> None:
    sparse = topk_sparsify(gaussian(5000), 0.02)
    payload = bytearray(encode_sparse(sparse, 2))
    numel = sparse.numel()
    if damage == "truncated":
        payload = payload[:-3]
    elif damage == "count":
        payload[1:5] = (10**6).to_bytes(4, "little")
    elif damage == "rice":
        payload[5] = 200  # a Rice parameter no encoder writes
    elif damage == "unary":
        payload[6:10] = (int.from_bytes(payload[6:10], "little") - 1).to_bytes(4, "little")
    elif damage == "gap":
        payload[10] = 0  # the first quotient's terminating one is gone: positions shift past their count
    else:
        numel = 100  # the payload's positions run past the vector
    with pytest.raises(CodecMismatchError):
        quantizer("topk").decode(bytes(payload), numel, 0)


def test_topk_islands_merge_into_the_same_anchor_with_a_fraction_of_the_bytes(local_swarm: LocalSwarm) -> None:
    local_swarm.bootstrap()
    args = ["--outer-steps", "4", "--quorum", "2", "--target-group-size", "2", "--wait-for-islands", "2"]
    args += ["--num-shards", "2"]
    islands = [local_swarm.peer(f"topk-{i}", *args, "--codec", "topk", "--shard-index", str(i)) for i in range(2)]
    for island in islands:
        assert island.wait(240) == 0, island.log_text()[-3000:]
    first, second = (island.records() for island in islands)
    by_step = {r["outer_step"]: r for r in second}
    merged = [r for r in first if r["merged"] and by_step.get(r["outer_step"], {}).get("merged")]
    assert len(merged) >= 3, [(r["outer_step"], r["merged"], r["note"]) for r in first]
    for record in merged:
        assert record["anchor_digest"] == by_step[record["outer_step"]]["anchor_digest"]
    from conftest import TINY

    from p2p_diloco.config import load_config
    from p2p_diloco.train.model import build_model, count_parameters

    parameters = count_parameters(build_model(load_config(TINY).model, seed=0))
    fp32_bytes = parameters * 4  # what an fp32 round sends, about the vector once
    sent = [r["bytes_sent"] / fp32_bytes for r in merged]
    assert max(sent) < 0.1, sent  # 2% of the values at about 11 bits each, and the union on the way back
    assert first[-1]["eval_loss"] < first[0]["eval_loss"]


def test_topk_defaults_to_outer_sgd_and_a_faded_residual_unless_set(tmp_path: Path) -> None:
    from p2p_diloco.config import SPARSE_DEFAULTS, ConfigError, load_config

    lr, decay = SPARSE_DEFAULTS["train.outer_lr"], SPARSE_DEFAULTS["network.error_feedback_decay"]
    plain = load_config(overrides={"network.codec": "fp32"})
    assert (plain.train.outer_lr, plain.train.outer_momentum, plain.network.error_feedback_decay) == (0.7, 0.9, 1.0)
    sparse = load_config(overrides={"network.codec": "topk"})
    assert (sparse.train.outer_lr, sparse.train.outer_momentum, sparse.network.error_feedback_decay) == (lr, 0.0, decay)
    chosen = load_config(overrides={"network.codec": "topk", "train.outer_momentum": 0.5}).train
    assert (chosen.outer_lr, chosen.outer_momentum) == (lr, 0.5)
    config = tmp_path / "peer.toml"
    config.write_text('[network]\ncodec = "topk"\nerror_feedback_decay = 1.0\n[train]\nouter_lr = 0.8\n')
    from_file = load_config(config)
    assert (from_file.train.outer_lr, from_file.train.outer_momentum) == (0.8, 0.0)
    assert from_file.network.error_feedback_decay == 1.0
    with pytest.raises(ConfigError, match="robust_merge 'median'"):
        load_config(overrides={"network.codec": "topk", "network.robust_merge": "median"})
    with pytest.raises(ConfigError, match="error_feedback_decay"):
        load_config(overrides={"network.codec": "topk", "network.error_feedback_decay": 2.0})
