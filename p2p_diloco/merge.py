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


def is_finite(tensor: torch.Tensor) -> bool:
    """True when every value is finite: a NaN or inf update from a peer must never be applied."""
    return bool(torch.isfinite(tensor).all())
