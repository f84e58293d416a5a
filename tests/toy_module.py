"""A user model for the `module` kind: an embedding and a linear head whose forward returns (logits, loss)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Bigram(nn.Module):
    """Predicts the next byte from the current one."""

    def __init__(self, vocab: int = 256, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        logits = self.head(self.embed(input_ids))
        loss = None if labels is None else F.cross_entropy(logits.view(-1, logits.size(-1)), labels.reshape(-1))
        return logits, loss


class LossOnly(Bigram):
    """The same model returning only its loss."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        return super().forward(input_ids, labels)[1]


def build() -> nn.Module:
    """The factory `toy_module:build`."""
    return Bigram()


def build_loss_only() -> nn.Module:
    """The factory `toy_module:build_loss_only`."""
    return LossOnly()


def build_nothing() -> str:
    """A factory that returns no module."""
    return "not a module"
