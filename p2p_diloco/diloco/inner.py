"""DiLoCo's inner loop in pure torch: local AdamW steps on an island's own batches, shared by islands and benchmarks."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]
LossFunction = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def default_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss of a model whose forward(inputs, targets) returns (logits, loss), as the built-in GPT does."""
    return model(inputs, targets)[1]


def make_inner_optimizer(
    model: nn.Module, lr: float, weight_decay: float, warmup_steps: int, *, fused: bool = False
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """Inner AdamW with linear warm-up (fused kernels on CUDA when `fused`); its state stays on this island."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        **({"fused": True} if fused else {}),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / max(1, warmup_steps)))
    return optimizer, scheduler


def dynamic_inner_steps(
    steps: int, step_time_s: float | None, others_step_time_s: list[float | None], *, enabled: bool = True
) -> int:
    """Dynamic local updates (Liu et al. 2024): floor(speed / fastest speed * H), so slow islands arrive with the
    rest; H when disabled or until this island has timed a step."""
    if not enabled or not step_time_s:
        return steps
    times = [t for t in others_step_time_s if isinstance(t, (int, float)) and t > 0] + [step_time_s]
    return max(1, int(steps * min(times) / step_time_s))


@dataclass
class InnerResult:
    """What a run of inner steps did."""

    losses: list[float]
    """Training loss of every step."""
    tokens: int
    """Input tokens consumed."""
    seconds: float
    """Wall time of the steps."""


def run_inner_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    next_batch: Callable[[], Batch],
    steps: int,
    *,
    grad_clip: float = 0.0,
    loss_function: LossFunction = default_loss,
    after_backward: Callable[[torch.Tensor], torch.Tensor] | None = None,
    slowdown: float = 1.0,
    should_stop: Callable[[], bool] | None = None,
    accumulate: int = 1,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    scaler: torch.amp.GradScaler | None = None,
    device: torch.device | None = None,
    sync_context: Callable[[bool], contextlib.AbstractContextManager] | None = None,
) -> InnerResult:
    """Run `steps` local optimizer steps and return their losses.

    Each step accumulates the gradients of `accumulate` micro-batches, with the forward pass under `autocast` and,
    for fp16, the loss scaled by `scaler`. `after_backward(loss)` runs between backward and the optimizer step and
    returns the loss to record (a data-parallel baseline all-reduces the gradients there); `slowdown` > 1
    stretches each step (experiments); `should_stop()` is asked before each step and ends the run early.
    `sync_context(last)` wraps each micro-batch's backward (DDP: no gradient all-reduce until the last one).
    """
    if steps <= 0:
        return InnerResult([], 0, 0.0)
    model.train()
    losses, tokens = [], 0
    start = time.monotonic()
    for _ in range(steps):
        if should_stop is not None and should_stop():
            break
        step_start = time.monotonic()
        optimizer.zero_grad(set_to_none=True)
        total = None
        for micro in range(accumulate):
            inputs, targets = next_batch()
            if device is not None:
                inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            with contextlib.nullcontext() if sync_context is None else sync_context(micro == accumulate - 1):
                with autocast():
                    loss = loss_function(model, inputs, targets) / accumulate
                (loss if scaler is None else scaler.scale(loss)).backward()
            total = loss.detach() if total is None else total + loss.detach()
            tokens += inputs.numel()
        losses.append(total if after_backward is None else after_backward(total))
        _optimizer_step(model, optimizer, grad_clip, scaler)
        scheduler.step()
        if slowdown > 1:  # emulate slower hardware
            time.sleep((slowdown - 1) * (time.monotonic() - step_start))
    # One transfer for the whole run: a .item() per step would stall a GPU every step.
    values = torch.stack(losses).float().cpu().tolist() if losses else []
    return InnerResult(values, tokens, time.monotonic() - start)


def _optimizer_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float, scaler: torch.amp.GradScaler | None
) -> None:
    """Clip (the unscaled gradients, with fp16) and step; an fp16 step with inf gradients is skipped by the scaler."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
