"""Error feedback: the quantization residual of one round carried into the next, in fp32 (pure torch)."""

from __future__ import annotations

import torch


class ErrorFeedback:
    """Carries the quantization residual of one round into the next, in fp32.

    Each round: `compensated = ef.compensate(delta)`; send `compensated`; `ef.update(round_trip(codec,
    compensated), compensated)`. The sum of what was sent then equals the sum of the deltas minus the current
    residual, so quantization errors no longer accumulate. When a round is discarded and the island applies its
    own full-precision `compensated` instead, call `clear()`: nothing was lost.
    """

    def __init__(self) -> None:
        self.residual: torch.Tensor | None = None

    def compensate(self, delta: torch.Tensor) -> torch.Tensor:
        """`delta + residual` in fp32 (a new tensor)."""
        delta = delta.detach().to(torch.float32)
        if self.residual is None:
            return delta.clone()
        if self.residual.shape != delta.shape:
            raise ValueError(f"error feedback residual has shape {tuple(self.residual.shape)}, delta {delta.shape}")
        return delta + self.residual

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
