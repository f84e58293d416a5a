"""What one round of an island produced: the merge outcome, an exchange in flight, a merge that landed."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from p2p_diloco.net.exchange import ExchangeResult


@dataclass
class RoundOutcome:
    """How one outer step's merge went, for logs and metrics."""

    partners: int
    merged: bool
    resynced: bool
    note: str | None
    stale_by: int | None = None
    """Set when the group rejected this island's contribution as too stale: its staleness against the group."""


@dataclass
class PendingMerge:
    """A fragment's exchange running in the background while the island keeps training."""

    fragment: int | None
    pre_digest: str
    delta: torch.Tensor
    staleness: int
    swarm_step: int
    future: Future | None = None


@dataclass
class Landed:
    """A merge that has been applied (or discarded) in this round, for the round's record."""

    result: ExchangeResult
    outcome: RoundOutcome
    fragment: int | None
    blocked_s: float = 0.0
    """Seconds training waited for this merge (the whole exchange without overlap)."""
    staleness: int = 0
    swarm_step: int = 0


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
