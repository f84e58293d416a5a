"""Error feedback: the quantization residual of one round carried into the next, in fp32 (pure torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from p2p_diloco.config import NetworkConfig


class ErrorFeedback:
    """Carries the quantization residual of one round into the next, in fp32.

    Each round: `compensated = ef.compensate(delta)`; send `compensated`; `ef.update(round_trip(codec,
    compensated), compensated)`. The sum of what was sent then equals the sum of the deltas minus the current
    residual, so quantization errors no longer accumulate. When a round is discarded and the island applies its
    own full-precision `compensated` instead, call `clear()`: nothing was lost.

    `decay` < 1 fades the residual each round (`delta + decay * residual`). Islands restart every round from the
    merged anchor and learn much of what they could not send again, so a residual kept whole counts it twice; with
    top-k, where 98% of each round waits in the residual, fading it trains better (see benchmarks/sparse_horizon.py).
    """

    def __init__(self, decay: float = 1.0) -> None:
        if not 0 <= decay <= 1:
            raise ValueError(f"error feedback decay must be in [0, 1], got {decay}")
        self.decay = decay
        self.residual: torch.Tensor | None = None

    @classmethod
    def per_fragment(cls, numbers: list[int], network: NetworkConfig) -> dict[int, ErrorFeedback] | None:
        """One per fragment number with the network's decay, or None when error feedback is off (always on with
        codec topk, which leaves the most behind)."""
        if not (network.error_feedback or network.codec == "topk"):
            return None
        return {number: cls(network.error_feedback_decay) for number in numbers}

    def compensate(self, delta: torch.Tensor) -> torch.Tensor:
        """`delta + decay * residual` in fp32 (a new tensor)."""
        delta = delta.detach().to(torch.float32)
        if self.residual is None:
            return delta.clone()
        if self.residual.shape != delta.shape:
            raise ValueError(f"error feedback residual has shape {tuple(self.residual.shape)}, delta {delta.shape}")
        return delta.add(self.residual, alpha=self.decay)

    def update(self, sent_decoded: torch.Tensor, compensated: torch.Tensor) -> None:
        """Remember what the codec dropped this round: `compensated - sent_decoded`."""
        if sent_decoded.shape != compensated.shape:
            raise ValueError(f"shapes differ: sent {tuple(sent_decoded.shape)}, compensated {compensated.shape}")
        self.residual = compensated.detach().to(torch.float32) - sent_decoded.detach().to(torch.float32)
        if not bool(torch.isfinite(self.residual).all()):
            self.residual = None  # never carry NaN or inf into later rounds

    def clear(self) -> None:
        """Forget the residual (after applying the full-precision update locally, or after a resync)."""
        self.residual = None
