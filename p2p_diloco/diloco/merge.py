"""Merging pseudo-gradients from several islands, in pure torch."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


class MergeError(ValueError):
    """Contributions that cannot be merged (shape mismatch, bad weights, non-finite values)."""


def weighted_mean(contributions: Sequence[torch.Tensor], weights: Sequence[float] | None = None) -> torch.Tensor:
    """Weighted mean of pseudo-gradients, accumulated in fp32: sum(w_i * d_i) / sum(w_i)."""
    if not contributions:
        raise MergeError("nothing to merge")
    shape = contributions[0].shape
    for tensor in contributions:
        if tensor.shape != shape:
            raise MergeError(f"cannot merge pseudo-gradients of shapes {tuple(shape)} and {tuple(tensor.shape)}")
    weights = [1.0] * len(contributions) if weights is None else [float(w) for w in weights]
    bad = any(not math.isfinite(w) or w < 0 for w in weights)
    if len(weights) != len(contributions) or bad or sum(weights) <= 0:
        raise MergeError(f"merge weights must be non-negative with a positive sum, got {weights}")
    total = torch.zeros(shape, dtype=torch.float32)
    for tensor, weight in zip(contributions, weights):
        total.add_(tensor.float(), alpha=weight)
    return total.div_(sum(weights))


def contributor_mean(total: torch.Tensor, coverage: torch.Tensor, heaviest: float | None = None) -> torch.Tensor:
    """`total / coverage` in place, the merge of top-k contributions: each value averaged over the weight that sent
    it, where a plain mean would count every island that left it out as voting 0 and shrink values few islands
    chose by up to the group's size (the CCLoco reference optimizer averages the same way). The divisor is at least
    `heaviest` (the largest sender weight), so a value only a discounted island sent keeps its discount."""
    return total.div_(coverage.clamp(min=heaviest if heaviest else torch.finfo(coverage.dtype).tiny))


def sparse_mean(contributions: Sequence[torch.Tensor], weights: Sequence[float] | None = None) -> torch.Tensor:
    """The weighted mean of each value over the contributions that hold it (non-zero): `contributor_mean`."""
    weights = [1.0] * len(contributions) if weights is None else [float(w) for w in weights]
    merged = rescale_to_contributors(weighted_mean(contributions, weights).view(-1), contributions, weights)
    return merged.view_as(contributions[0])


def rescale_to_contributors(
    merged: torch.Tensor, contributions: Sequence[torch.Tensor], weights: Sequence[float]
) -> torch.Tensor:
    """A merge over all contributions (zeros included, e.g. a robust rule's) scaled, value by value, from their total
    weight to the weight of those that hold the value: the plain mean becomes `contributor_mean` (flat tensors)."""
    coverage = torch.zeros_like(merged)
    for tensor, weight in zip(contributions, weights):
        coverage.add_(tensor.reshape(-1) != 0, alpha=float(weight))
    return contributor_mean(merged.mul(float(sum(weights))), coverage, max(map(float, weights), default=0.0))


def is_finite(tensor: torch.Tensor) -> bool:
    """True when every value is finite: a NaN or inf update from a peer must never be applied."""
    return bool(torch.isfinite(tensor).all())


MERGE_RULES = ("mean", "tokens", "rda")


def contribution_weight(rule: str, c_tokens: float, c_steps: float) -> float:
    """An island's weight in the merge: 1 for 'mean', else c_tokens * (c_tokens / c_steps) (Decoupled DiLoCo)."""
    if rule not in MERGE_RULES:
        raise MergeError(f"unknown merge rule {rule!r}; use one of {', '.join(MERGE_RULES)}")
    if rule == "mean":
        return 1.0
    if c_steps <= 0 or c_tokens <= 0:
        raise MergeError(f"a contribution needs positive c_tokens and c_steps, got {c_tokens} and {c_steps}")
    return float(c_tokens) * (float(c_tokens) / float(c_steps))


def _split(flat: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    if sum(sizes) > flat.numel():
        raise MergeError(f"tensor sizes add up to {sum(sizes)}, the vector has {flat.numel()} values")
    return list(torch.split(flat[: sum(sizes)], list(sizes)))


def rda_encode(delta: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """Per tensor: the unit direction, then all the norms at the end, so a weighted mean of encodings gives RDA."""
    pieces = _split(delta.float(), sizes)
    norms = torch.stack([piece.norm() for piece in pieces])
    directions = [piece / norm if norm > 0 else torch.zeros_like(piece) for piece, norm in zip(pieces, norms)]
    return torch.cat([*directions, norms])


def rda_decode(encoded: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """Mean norm times the normalised mean direction, per tensor."""
    directions = _split(encoded, sizes)
    norms = encoded[sum(sizes) :]
    if norms.numel() != len(sizes):
        raise MergeError(f"an RDA encoding of {len(sizes)} tensors needs {len(sizes)} norms, got {norms.numel()}")
    out = []
    for direction, norm in zip(directions, norms):
        length = direction.norm()
        out.append(direction * (norm / length) if length > 0 else torch.zeros_like(direction))
    return torch.cat(out)


def radial_directional_average(
    contributions: Sequence[torch.Tensor], weights: Sequence[float] | None, sizes: Sequence[int]
) -> torch.Tensor:
    """Radial-Directional Averaging: weighted mean of norms times normalised weighted mean of directions."""
    encoded = [rda_encode(delta, sizes) for delta in contributions]
    return rda_decode(weighted_mean(encoded, weights), sizes)
