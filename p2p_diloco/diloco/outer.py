"""DiLoCo's outer loop in pure torch: pseudo-gradients, the outer Nesterov optimizer, state digests."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector


def flatten_parameters(parameters: Iterable[nn.Parameter]) -> torch.Tensor:
    """One flat fp32 copy of the parameters, in module order."""
    return parameters_to_vector([p.detach() for p in parameters]).float().clone()


@torch.no_grad()
def assign_parameters_(parameters: Iterable[nn.Parameter], flat: torch.Tensor) -> None:
    """Copy the values of a flat vector into the parameters (copies: the parameters never alias `flat`)."""
    parameters = list(parameters)
    total = sum(parameter.numel() for parameter in parameters)
    if total != flat.numel():
        raise ValueError(f"flat vector has {flat.numel()} values, the parameters {total}")
    offset = 0
    for parameter in parameters:
        count = parameter.numel()
        parameter.copy_(flat[offset : offset + count].view_as(parameter))
        offset += count


def pseudo_gradient(anchor: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Outer pseudo-gradient: anchor (weights at the last outer step) minus the local weights."""
    return anchor - local


class OuterOptimizer:
    """SGD with Nesterov momentum on the flat anchor; its momentum is kept across outer steps.

    With momentum_every = N > 1 it is Delayed Nesterov (Liu et al. 2024): every step uses the current momentum
    for the look-ahead, but the momentum itself absorbs the mean of the buffered pseudo-gradients only every N
    steps, which undoes the distortion of many small asynchronous updates.
    """

    def __init__(self, anchor: torch.Tensor, lr: float = 0.7, momentum: float = 0.9, momentum_every: int = 1):
        if momentum_every < 1:
            raise ValueError(f"momentum_every must be >= 1, got {momentum_every}")
        self.anchor = nn.Parameter(anchor.detach().float().clone(), requires_grad=False)
        self.optimizer = torch.optim.SGD([self.anchor], lr=lr, momentum=momentum, nesterov=momentum > 0)
        self.lr, self.beta, self.momentum_every = lr, momentum, momentum_every
        self.pending: torch.Tensor | None = None
        self.pending_count = 0

    @torch.no_grad()
    def step(self, outer_gradient: torch.Tensor) -> torch.Tensor:
        """Apply one outer step with the (merged) pseudo-gradient and return the new anchor."""
        # The anchor may live on the model's device (--outer-device same); merges arrive on the CPU.
        gradient = outer_gradient.detach().float().to(self.anchor.device).reshape_as(self.anchor)
        if self.momentum_every == 1:
            self.anchor.grad = gradient.clone()
            self.optimizer.step()
            self.anchor.grad = None
            return self.anchor.data
        self.pending = gradient.clone() if self.pending is None else self.pending.add_(gradient)
        self.pending_count += 1
        buffer = self.momentum()
        if self.pending_count == self.momentum_every:
            buffer = buffer.mul(self.beta).add_(self.pending, alpha=1.0 / self.pending_count)
            self.optimizer.state[self.anchor]["momentum_buffer"] = buffer
            self.pending, self.pending_count = None, 0
        self.anchor.data.add_(gradient + self.beta * buffer, alpha=-self.lr)
        return self.anchor.data

    @torch.no_grad()
    def step_fragment(self, outer_gradient: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """One outer step on the anchor values at `index` only (a Streaming DiLoCo fragment); returns them.

        The same Nesterov arithmetic as torch's SGD, elementwise, so the other fragments' momentum is untouched.
        """
        if self.momentum_every != 1:
            raise ValueError("Delayed Nesterov (momentum_every > 1) is not supported with fragments")
        gradient = outer_gradient.detach().float().to(self.anchor.device).reshape(-1)
        index = index.to(self.anchor.device)
        state = self.optimizer.state[self.anchor]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(self.anchor.data)
        buffer = state["momentum_buffer"]
        if self.beta > 0:
            fragment_buffer = buffer[index].mul_(self.beta).add_(gradient)
            buffer[index] = fragment_buffer
            gradient = gradient.add(fragment_buffer, alpha=self.beta)
        values = self.anchor.data[index].add_(gradient, alpha=-self.lr)
        self.anchor.data[index] = values
        return values

    def momentum(self) -> torch.Tensor:
        """The momentum buffer (zeros before the first step)."""
        buffer = self.optimizer.state.get(self.anchor, {}).get("momentum_buffer")
        return torch.zeros_like(self.anchor.data) if buffer is None else buffer

    @torch.no_grad()
    def load(self, anchor: torch.Tensor, momentum: torch.Tensor | None) -> None:
        """Replace anchor and momentum, e.g. with a state downloaded from a peer."""
        self.anchor.data.copy_(anchor.reshape(self.anchor.shape))
        self.pending, self.pending_count = None, 0
        state = self.optimizer.state[self.anchor]
        if momentum is None:
            state.pop("momentum_buffer", None)
        else:
            momentum = momentum.detach().float().reshape(self.anchor.shape)
            state["momentum_buffer"] = momentum.to(self.anchor.device, copy=True)

    def state_dict(self) -> dict[str, Any]:
        """Anchor and momentum as plain tensors."""
        return {"anchor": self.anchor.data.clone(), "momentum": self.momentum().clone()}


def state_digest(*tensors: torch.Tensor) -> str:
    """Short hash of exact tensor bytes: islands on the same lineage of outer steps have equal digests."""
    import hashlib

    hasher = hashlib.blake2b(digest_size=8)
    for tensor in tensors:
        hasher.update(f"{tensor.dtype}{tuple(tensor.shape)};".encode())
        hasher.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()
