"""What one round of an island produced: the verdict on an exchange, an exchange in flight, a merge that landed."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from p2p_diloco.net.exchange import ExchangeResult


@dataclass(frozen=True)
class Verdict:
    """What an exchange gave this island's contribution: the update to apply, or why not."""

    result: ExchangeResult
    """The exchange as the network saw it."""
    update: torch.Tensor | None
    """The group's merge, or this island's own update when the round was discarded; None when stale."""
    merged: bool
    """True when `update` is the group's merge."""
    note: str | None = None
    """Why the round was discarded (or None)."""
    stale_by: int | None = None
    """Set when the group gave this island weight 0 for staleness: how many steps behind the group it is."""
    weights: dict[str, float | None] = field(default_factory=dict)
    """Merge weight of every member, this island's first (only its own when nothing merged)."""
    partners: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Gathered metadata of the partners whose contributions are in `update` (empty when nothing merged)."""
    transport: tuple[int, int] | None = None
    """Cumulative TCP bytes of the island's daemon, read right after an overlapped exchange."""


@dataclass(frozen=True)
class RoundOutcome:
    """How one outer step's merge went, for logs and metrics."""

    partners: int
    merged: bool
    resynced: bool
    note: str | None


@dataclass
class PendingMerge:
    """A fragment's exchange running in the background (or done in this thread) while the island trains."""

    contribution: Any
    """The island's `Contribution` being exchanged."""
    staleness: int
    swarm_step: int
    future: Future


@dataclass(frozen=True)
class Landed:
    """A merge that has been applied (or discarded) in this round, for the round's record."""

    verdict: Verdict
    outcome: RoundOutcome
    fragment: int | None
    """The fragment's label (None for the whole model)."""
    blocked_s: float
    """Seconds training waited for this merge (the whole exchange without overlap)."""
    exchange_s: float
    """Seconds the exchange took, resync included."""
    staleness: int
    swarm_step: int


def nothing_landed(note: str) -> Landed:
    """The record of a round in which no merge landed (the first round with overlap)."""
    verdict = Verdict(ExchangeResult(merged=None), None, merged=False)
    return Landed(verdict, RoundOutcome(0, False, False, note), None, 0.0, 0.0, 0, 0)


def done(value: Any) -> Future:
    """A future that already holds `value` (a blocking exchange)."""
    future: Future = Future()
    future.set_result(value)
    return future


def in_background(function: Callable[..., Any], *args: Any) -> Future:
    """Run `function(*args)` in a daemon thread (an exchange in flight must never hold up the exit)."""
    future: Future = Future()

    def target() -> None:
        try:
            future.set_result(function(*args))
        except BaseException as error:  # handed to whoever lands the exchange
            future.set_exception(error)

    threading.Thread(target=target, name="exchange", daemon=True).start()
    return future
