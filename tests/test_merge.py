"""Merging pseudo-gradients: weighted mean in fp32 and the finiteness guard."""

from __future__ import annotations

import math

import pytest
import torch

from p2p_diloco.diloco.merge import MergeError, is_finite, weighted_mean


def test_weighted_mean_matches_hand_computation():
    a = torch.tensor([1.0, 2.0, -4.0, 8.0])
    b = torch.tensor([5.0, -2.0, 0.0, 0.5])
    merged = weighted_mean([a, b], [1, 3])
    expected = torch.tensor([(1 + 15) / 4, (2 - 6) / 4, -4 / 4, (8 + 1.5) / 4])
    torch.testing.assert_close(merged, expected, atol=1e-6, rtol=0)


def test_weighted_mean_three_contributions_with_a_zero_weight():
    a, b, c = torch.full((2, 3), 1.0), torch.full((2, 3), 4.0), torch.full((2, 3), 1000.0)
    merged = weighted_mean([a, b, c], [0.5, 1.5, 0.0])
    assert merged.shape == (2, 3)
    torch.testing.assert_close(merged, torch.full((2, 3), (0.5 * 1 + 1.5 * 4) / 2.0))


def test_equal_weights_and_no_weights_give_the_plain_mean():
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(5, 7, generator=generator) for _ in range(3)]
    mean = torch.stack(tensors).mean(dim=0)
    torch.testing.assert_close(weighted_mean(tensors), mean)
    torch.testing.assert_close(weighted_mean(tensors, [2.0, 2.0, 2.0]), mean)


def test_weighted_mean_of_one_is_a_copy():
    a = torch.tensor([1.0, 2.0])
    merged = weighted_mean([a], [5.0])
    assert torch.equal(merged, a)
    merged.add_(1.0)
    assert torch.equal(a, torch.tensor([1.0, 2.0])), "the result must not alias a contribution"


def test_shape_mismatch_raises_with_both_shapes():
    with pytest.raises(MergeError, match=r"\(2, 3\).*\(3, 2\)"):
        weighted_mean([torch.zeros(2, 3), torch.zeros(3, 2)])


def test_same_numel_different_shape_is_still_a_mismatch():
    with pytest.raises(MergeError, match="shapes"):
        weighted_mean([torch.zeros(6), torch.zeros(2, 3)], [1, 1])


@pytest.mark.parametrize("weights", [[1.0, -1.0], [-1.0, 3.0], [0.0, 0.0], [1.0], [1.0, 1.0, 1.0]])
def test_bad_weights_raise_with_the_weights_in_the_message(weights):
    with pytest.raises(MergeError, match="non-negative with a positive sum") as info:
        weighted_mean([torch.ones(3), torch.ones(3)], weights)
    assert str([float(w) for w in weights]) in str(info.value)


def test_nothing_to_merge_raises():
    with pytest.raises(MergeError, match="nothing to merge"):
        weighted_mean([])


def test_merge_error_is_a_value_error():
    assert issubclass(MergeError, ValueError)


def test_half_precision_inputs_are_accumulated_in_fp32():
    # 60000 + 60000 overflows fp16 (max 65504): an fp16 accumulator would give inf.
    a = torch.full((4,), 60000.0, dtype=torch.float16)
    b = torch.full((4,), 60000.0, dtype=torch.float16)
    merged = weighted_mean([a, b], [1.0, 1.0])
    assert merged.dtype == torch.float32
    assert torch.equal(merged, torch.full((4,), 60000.0))
    assert is_finite(merged)


def test_half_precision_small_differences_survive():
    # fp16 has 11 significant bits: 2048 + 1 is not representable, so fp16 accumulation would lose the 1.
    a = torch.tensor([2048.0], dtype=torch.float16)
    b = torch.tensor([1.0], dtype=torch.float16)
    merged = weighted_mean([a, b], [1.0, 1.0])
    assert merged.item() == pytest.approx(1024.5)


def test_is_finite():
    assert is_finite(torch.tensor([0.0, -1.0, 1e30]))
    assert is_finite(torch.tensor([1, 2, 3]))
    assert not is_finite(torch.tensor([0.0, math.nan]))
    assert not is_finite(torch.tensor([math.inf, 0.0]))
    assert not is_finite(torch.tensor([0.0, -math.inf]))
    assert not is_finite(torch.tensor([1.0, math.nan], dtype=torch.float16))
    assert isinstance(is_finite(torch.zeros(2)), bool)


def test_non_finite_contribution_propagates_to_the_merge():
    merged = weighted_mean([torch.tensor([1.0, 2.0]), torch.tensor([math.nan, 2.0])], [1, 1])
    assert not is_finite(merged)
    assert merged[1].item() == 2.0


def test_canonical_lineage_prefers_advanced_then_common_then_smallest_digest() -> None:
    from p2p_diloco.diloco.lineage import canonical_lineage, donors

    members = {"a": (3, "x"), "b": (3, "y"), "c": (3, "y"), "d": (2, "z")}
    assert canonical_lineage(members) == (3, "y")
    assert donors(members, (3, "y")) == ["b", "c"]
    assert canonical_lineage({"a": (4, "q"), "b": (3, "y"), "c": (3, "y")}) == (4, "q")
    tie = {"a": (3, "b2"), "b": (3, "a1")}
    assert canonical_lineage(tie) == (3, "b2") == canonical_lineage(dict(reversed(list(tie.items()))))
