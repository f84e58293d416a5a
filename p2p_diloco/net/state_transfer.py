"""Downloading the swarm's outer state so that no single donor decides it: ask several, adopt what they agree on.

A newcomer (or a resyncing island) asks up to PROBE_DONORS donors for their state's (outer step, digest, model)
with a cheap metadata-only request, keeps the claim most distinct donors agree on (a donor's self-declared
priority plays no part), then downloads from those donors in turn and adopts a state only if its own digest of
the bytes matches the claim, every tensor has the shape the model expects and every value is finite. A donor
that fails any check is named in the log and banned for a while; the next one is tried.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.p2p import PeerID

from p2p_diloco.diloco.outer import state_digest

logger = logging.getLogger(__name__)

PROBE_DONORS = 5
"""How many donors a newcomer asks for their state's digest before downloading."""

State = tuple[dict[str, Any], list[torch.Tensor]]
AnchorSink = Callable[[dict[str, Any], torch.Tensor], None]
"""Gets a donor's metadata and its state's first tensor (the anchor) as soon as that is in."""


@dataclass(frozen=True)
class Claim:
    """What a donor says its state is."""

    outer_step: int
    digest: str
    fingerprint: str


def claim_of(metadata: Any) -> Claim | None:
    """A donor's claim from its state metadata (None if malformed)."""
    if not isinstance(metadata, dict):
        return None
    step, digest, fingerprint = metadata.get("outer_step"), metadata.get("digest"), metadata.get("fingerprint")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return None
    if not isinstance(digest, str) or not isinstance(fingerprint, str):
        return None
    return Claim(step, digest, fingerprint)


def choose(claims: dict[PeerID, Claim], fingerprint: str | None, max_step: int | None) -> tuple[Claim, list[PeerID]]:
    """The claim most distinct donors agree on (ties: the newer step), with its donors in random order.

    Only claims of our model are counted, and none past `max_step` (what the swarm can plausibly have reached).
    Raises LookupError when no claim is left.
    """
    usable = {
        peer: claim
        for peer, claim in claims.items()
        if (fingerprint is None or claim.fingerprint == fingerprint)
        and (max_step is None or claim.outer_step <= max_step)
    }
    if not usable:
        raise LookupError("no donor claims a usable state")
    votes = Counter(usable.values())
    best = max(votes, key=lambda claim: (votes[claim], claim.outer_step))
    donors = [peer for peer, claim in usable.items() if claim == best]
    random.shuffle(donors)
    return best, donors


def problem(state: State, claim: Claim, shapes: Sequence[tuple[int, ...]] | None) -> str | None:
    """Why a downloaded state cannot be adopted (None: it can)."""
    metadata, tensors = state
    if claim_of(metadata) != claim:
        return f"its state says {claim_of(metadata)}, not the {claim} it claimed"
    if shapes is not None and [tuple(t.shape) for t in tensors] != [tuple(s) for s in shapes]:
        return f"tensors of shapes {[tuple(t.shape) for t in tensors]}, the model needs {[tuple(s) for s in shapes]}"
    if not all(t.is_floating_point() and bool(torch.isfinite(t).all()) for t in tensors):
        return "NaN or inf values"
    if state_digest(*tensors) != claim.digest:
        return f"bytes whose digest {state_digest(*tensors)} is not the {claim.digest} it claimed"
    return None


def moved_on(state: State, claim: Claim) -> bool:
    """True when a donor sent a newer state than it claimed, consistent in itself: it trained on since the probe."""
    metadata, tensors = state
    newer = claim_of(metadata)
    return (
        newer is not None
        and newer.outer_step > claim.outer_step
        and newer.fingerprint == claim.fingerprint
        and all(t.is_floating_point() for t in tensors)
        and state_digest(*tensors) == newer.digest
    )


PROBE_ROUNDS = 3
"""How many times the donors are probed again when every agreeing donor trained on before its download."""


async def verified_download(
    donors: Sequence[PeerID],
    *,
    ask: Callable[[PeerID], Awaitable[Any]],
    download: Callable[[PeerID], Awaitable[State | None]],
    fingerprint: str | None,
    shapes: Sequence[tuple[int, ...]] | None,
    max_step: int | None,
    on_liar: Callable[[PeerID, str], None],
    timeout: float,
    on_anchor: AnchorSink | None = None,
) -> State | None:
    """Ask the donors for their claims, then download and verify the agreed state (None if nobody delivers it).

    With `on_anchor`, `download` is called as download(peer, sink), and a donor's anchor that matches the claim's
    step, the model's first shape and is finite goes on to `on_anchor` before the rest of its state is in (the
    digest can only be checked on the whole state: the receiver must drop what it did with an anchor that
    this function does not return in the end)."""
    for _ in range(PROBE_ROUNDS):
        claim, agreeing = await _probe(donors, ask, fingerprint, max_step, timeout)
        moved = 0
        for peer in agreeing:
            started = time.monotonic()
            sink = None if on_anchor is None else _anchor_sink(claim, shapes, on_anchor)
            try:
                fetching = download(peer) if sink is None else download(peer, sink)
                state = await asyncio.wait_for(fetching, timeout)
            except Exception as error:  # a donor that fails costs only itself
                logger.warning(f"could not download state from {peer}: {error!r}")
                continue
            if state is None:
                continue
            if (why := problem(state, claim, shapes)) is None:
                size = sum(tensor.numel() * tensor.element_size() for tensor in state[1])
                logger.info(
                    f"downloaded the outer state at step {claim.outer_step} ({size / 1e6:.1f} MB) from {peer} in "
                    f"{time.monotonic() - started:.1f}s"
                )
                return state
            if moved_on(state, claim):  # an honest donor trains on: probe again rather than blame it
                moved += 1
                continue
            on_liar(peer, f"a state with {why}")
        if not moved:
            return None
    return None


def _anchor_sink(claim: Claim, shapes: Sequence[tuple[int, ...]] | None, on_anchor: AnchorSink) -> AnchorSink:
    """Passes on an early anchor only if it can be the claimed state's: the claimed step, the model's shape, finite."""

    def sink(metadata: dict[str, Any], anchor: torch.Tensor) -> None:
        if claim_of(metadata) != claim or (shapes and tuple(anchor.shape) != tuple(shapes[0])):
            return
        if anchor.is_floating_point() and bool(torch.isfinite(anchor).all()):
            on_anchor(metadata, anchor)

    return sink


async def _probe(
    donors: Sequence[PeerID],
    ask: Callable[[PeerID], Awaitable[Any]],
    fingerprint: str | None,
    max_step: int | None,
    timeout: float,
) -> tuple[Claim | None, list[PeerID]]:
    """The claim most of the first PROBE_DONORS donors agree on and who agrees (None, [] when none is usable)."""
    probed = list(donors)[:PROBE_DONORS]
    answers = await asyncio.gather(*(asyncio.wait_for(ask(peer), timeout) for peer in probed), return_exceptions=True)
    claims = {}
    for peer, answer in zip(probed, answers):
        if isinstance(answer, BaseException):
            logger.debug(f"donor {peer} did not describe its state: {answer!r}")
        elif (claim := claim_of(answer)) is not None:
            claims[peer] = claim
    for peer, other in claims.items():
        if max_step is not None and other.outer_step > max_step:
            logger.warning(
                f"state donor {peer} claims outer step {other.outer_step}, which the swarm cannot have reached "
                f"(at most {max_step}): ignored"
            )
    try:
        claim, agreeing = choose(claims, fingerprint, max_step)
    except LookupError:
        return None, []
    # Donors a round apart are normal; a donor claiming the agreed step with other bytes is not.
    dissent = sorted(str(p) for p, other in claims.items() if other.outer_step == claim.outer_step and other != claim)
    if dissent:
        logger.warning(
            f"state donors disagree: {len(agreeing)} claim outer step {claim.outer_step} ({claim.digest}); "
            f"ignoring {', '.join(dissent)}"
        )
    return claim, agreeing
