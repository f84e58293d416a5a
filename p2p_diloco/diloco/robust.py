"""Robust aggregation of one part of a pseudo-gradient, in pure torch: what one bad member can do stays bounded.

Each reducer of the butterfly all-reduce sees one part of every member's vector; these rules need only that part
(the hivemind authors' "Secure Distributed Training at Scale" runs CenteredClip the same way), so they fit inside
the all-reduce without extra rounds:

    clip     CenteredClip (Karimireddy et al. 2021): start at the coordinate-wise median, then repeatedly move by
             the weighted mean of each member's difference clipped to radius tau (the median distance)
    trimmed  coordinate-wise trimmed mean: drop the largest and smallest ~20% of values (at least one of each when
             there are three members or more), weighted mean of the rest
    median   coordinate-wise median (weighted by nothing)

Before any rule, a member whose part is not finite is dropped, and every part is clipped to NORM_CLIP times the
median part norm, so neither a NaN nor a huge vector costs more than that member's own contribution; a part
OVERSIZED times the median names its sender.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ROBUST_MERGES = ("none", "clip", "trimmed", "median")
NORM_CLIP = 1.0
"""A part whose norm exceeds this multiple of the median part norm is scaled down to it. Honest islands of one run
send parts of similar norms, so the median itself costs them little (measured: 0.1% of the merge), while a larger
multiple lets one scaled-up member stretch the merge by as much (x1.2 at 3)."""
OVERSIZED = 3.0
"""A part this many times the median norm names its sender in the log: beyond honest variation."""
CLIP_ITERATIONS = 20
TRIM_FRACTION = 0.2


def finite_members(parts: Sequence[torch.Tensor]) -> list[int]:
    """Indices of the parts that hold only finite values."""
    return [i for i, part in enumerate(parts) if bool(torch.isfinite(part).all())]


def clip_norms(parts: torch.Tensor, multiple: float = NORM_CLIP) -> torch.Tensor:
    """Rows of `parts` scaled down to at most `multiple` x their median norm (a copy)."""
    norms = parts.norm(dim=1)
    bound = multiple * norms.median()
    if bound <= 0:
        return parts.clone()
    return parts * torch.clamp(bound / norms.clamp_min(1e-30), max=1.0)[:, None]


def centered_clip(parts: torch.Tensor, weights: torch.Tensor, iterations: int = CLIP_ITERATIONS) -> torch.Tensor:
    """Weighted CenteredClip of the rows of `parts`, from the coordinate-wise median, radius = median distance."""
    center = parts.median(dim=0).values
    tau = (parts - center).norm(dim=1).median()
    if tau <= 0:
        return center
    share = weights / weights.sum()
    for _ in range(iterations):
        difference = parts - center
        scale = torch.clamp(tau / difference.norm(dim=1).clamp_min(1e-30), max=1.0)
        step = (share * scale)[:, None].mul(difference).sum(dim=0)
        center = center + step
        if float(step.norm()) <= 1e-7 * max(1.0, float(center.norm())):
            break
    return center


def trimmed_mean(parts: torch.Tensor, weights: torch.Tensor, fraction: float = TRIM_FRACTION) -> torch.Tensor:
    """Coordinate-wise weighted mean after dropping the `fraction` largest and smallest values of each coordinate."""
    count = parts.shape[0]
    drop = max(1, int(fraction * count)) if count >= 3 else 0
    if drop == 0:
        return (weights[:, None] * parts).sum(dim=0) / weights.sum()
    order = parts.argsort(dim=0)
    kept = order[drop : count - drop]
    values = parts.gather(0, kept)
    kept_weights = weights[kept]
    return (kept_weights * values).sum(dim=0) / kept_weights.sum(dim=0)


def oversized(parts: torch.Tensor, multiple: float = OVERSIZED) -> dict[int, float]:
    """Rows whose norm exceeds `multiple` x the median norm, with how many times the median they are."""
    norms = parts.norm(dim=1)
    median = float(norms.median())
    if median <= 0:
        return {}
    return {i: float(norm) / median for i, norm in enumerate(norms) if float(norm) > multiple * median}


def aggregate(
    rule: str, parts: Sequence[torch.Tensor], weights: Sequence[float], flagged: dict[int, str] | None = None
) -> tuple[torch.Tensor, list[int]]:
    """The rule's aggregate of the finite parts (weighted where the rule weighs) and the dropped members' indices.

    'none' is the plain weighted mean (non-finite members still dropped). Members whose part was clipped are added
    to `flagged` (index -> why). Raises ValueError when no member has a finite part with positive weight.
    """
    if rule not in ROBUST_MERGES:
        raise ValueError(f"unknown robust merge {rule!r}; use one of {', '.join(ROBUST_MERGES)}")
    keep = [i for i in finite_members(parts) if weights[i] > 0]
    dropped = [i for i in range(len(parts)) if i not in keep and weights[i] > 0]
    if not keep:
        raise ValueError("no member sent a finite part with positive weight")
    stacked = torch.stack([parts[i].reshape(-1).float() for i in keep])
    kept_weights = torch.tensor([float(weights[i]) for i in keep], dtype=torch.float32)
    if rule == "none":
        return (kept_weights[:, None] * stacked).sum(dim=0) / kept_weights.sum(), dropped
    if flagged is not None:
        for row, ratio in oversized(stacked).items():
            flagged[keep[row]] = f"a pseudo-gradient {ratio:.0f}x the group's median norm (clipped)"
    stacked = clip_norms(stacked)
    if rule == "clip":
        return centered_clip(stacked, kept_weights), dropped
    if rule == "trimmed":
        return trimmed_mean(stacked, kept_weights), dropped
    return stacked.median(dim=0).values, dropped
