"""Where an island starts (the swarm's state, its own checkpoint or a fresh init) and what its checkpoints hold."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from p2p_diloco.config import NetworkConfig, PeerConfig
from p2p_diloco.diloco.staleness import plausible_limit, robust_clock
from p2p_diloco.island.announce import timed_pace_s
from p2p_diloco.island.early_anchor import PendingRestore, StateDownload, adoptable
from p2p_diloco.island.link import SwarmLink
from p2p_diloco.island.outer_state import OuterState
from p2p_diloco.island.resync import Resync
from p2p_diloco.island.trainer import LocalTrainer
from p2p_diloco.net.records import ModelMismatchError
from p2p_diloco.net.state_transfer import AnchorSink
from p2p_diloco.signals import GracefulStop
from p2p_diloco.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    unusable_checkpoints,
)
from p2p_diloco.train.model_files import describe

logger = logging.getLogger(__name__)

STATE_RETRY_S = 2.0
"""How often a newcomer asks again for the swarm's state while it waits for a donor."""


@dataclass(frozen=True)
class Restored:
    """Where an island starts: `pending` when it trains on the swarm's anchor while the rest downloads."""

    origin: str
    outer_step: int
    digest: str
    pending: PendingRestore | None = None


def restore(config: PeerConfig, state: OuterState, trainer: LocalTrainer, link: SwarmLink) -> Restored:
    """Start from the freshest of: the swarm's current state, this island's checkpoint, a fresh init.

    The model ends up holding the anchor: the swarm's as soon as it is in, the rest of its state then still on the
    way (`Restored.pending`, for the island to finish before its first exchange).
    """
    checkpoint = None
    if config.checkpoint_dir and not config.fresh:
        refuse_if_all_corrupt(config.checkpoint_dir)
    if config.checkpoint_dir and not config.fresh and (path := latest_checkpoint(config.checkpoint_dir)) is not None:
        checkpoint = load_checkpoint(path)
        if checkpoint.get("fingerprint") != state.fingerprint:
            raise ModelMismatchError(
                f"model mismatch: checkpoint {path} holds model {checkpoint.get('fingerprint')}, "
                f"the config builds {state.fingerprint}; point --checkpoint-dir elsewhere"
            )
        state.load(checkpoint["outer_tensors"], int(checkpoint["outer_step"]))
        trainer.load_state_dict(checkpoint)
    swarm = None
    if link.online:
        resync = Resync(link.exchange, state, timeout=config.network.state_timeout)
        own_step = state.outer_step if checkpoint is not None else None
        download = StateDownload(
            lambda sink: swarm_state(link, config.network, resync, own_step=own_step, on_anchor=sink)
        )
        if (pending := download.early(state)) is not None:
            trainer.load_all(pending.anchor)
            origin = f"swarm state at outer step {pending.outer_step} (its anchor; the rest still downloading)"
            return Restored(origin, pending.outer_step, pending.digest, pending)
        swarm = download.result()
    if swarm is not None and adoptable(int(swarm[0]["outer_step"]), state):
        state.adopt(*swarm, source="the swarm")
        origin = f"swarm state at outer step {state.outer_step}"
    elif checkpoint is not None:
        origin = f"checkpoint at outer step {state.outer_step}"
    else:
        origin = "fresh initialisation"
    trainer.load_all(state.anchor)
    return Restored(origin, state.outer_step, state.digest())


def _others(link: SwarmLink) -> dict[str, dict]:
    """The other islands' verified records (none if the DHT does not answer: they only bound the wait)."""
    try:
        return {peer: info for peer, info in link.records.read().items() if peer != link.peer_id}
    except Exception:
        return {}


def refuse_if_all_corrupt(directory: str) -> None:
    """Refuse to start (and so to prune them) when the folder holds checkpoints and every one is corrupt."""
    if latest_checkpoint(directory) is not None:
        return
    corrupt = unusable_checkpoints(directory)
    if corrupt:
        names = ", ".join(path.name for path in corrupt)
        raise CheckpointError(
            f"every checkpoint in {directory} is corrupt ({names}); nothing was deleted: pass --fresh to start over "
            "(they are then replaced), or point --checkpoint-dir elsewhere"
        )


def donor_step_limit(steps: list[int], announce_every: int) -> int | None:
    """The newest step an honest donor can be at when the run's records show `steps` (None: no records to judge by).

    Each island re-announces at least every `announce_every` rounds, so it can be that many rounds (plus the one in
    flight) past its record; a tighter bound turned honest donors away until their records caught up (5 s of a
    restart in benchmarks/chaos.py). The records' robust clock keeps one liar's record from raising the bound."""
    return robust_clock(steps) + max(1, announce_every) + 1 if steps else None


UNKNOWN_PACE_S = 4.0
"""The round time assumed of a record without two recent rounds to time: a step a second at `plausible_limit`'s 4x."""


def aged_steps(records: Iterable[Mapping[str, Any]], now: float) -> list[int]:
    """Each record's step, plus the rounds its island can have finished since it wrote it (`plausible_limit`).

    Records are only rewritten every few rounds, and not at all once their island died: a restarted island without
    an identity file saw its dead incarnation's record (at step 0) beside its donor's, the robust clock of the two
    took the older, and the donor 6 steps ahead was refused as impossible (benchmarks/restart_link.py, 38M). Aged,
    an old record no longer holds the bound down; a lone liar still cannot raise it (`robust_clock`)."""
    steps = []
    for info in records:
        step, written = info["outer_step"], info.get("time")
        if not isinstance(written, (int, float)) or isinstance(written, bool) or not math.isfinite(written):
            steps.append(step)
            continue
        steps.append(plausible_limit(step, now - written, _pace_s(info.get("history"))) - 1)
    return steps


def _pace_s(history: Any) -> float:
    """The median time between a record's recent rounds (`Progress.history`: time last), or UNKNOWN_PACE_S."""
    pace = timed_pace_s(history)
    return UNKNOWN_PACE_S if pace is None else pace


def swarm_state(
    link: SwarmLink,
    network: NetworkConfig,
    resync: Resync,
    *,
    own_step: int | None = None,
    on_anchor: AnchorSink | None = None,
) -> tuple[dict, list] | None:
    """The swarm's current state from a donor; while the run's records show islands more than a step past
    `own_step` (this island's checkpoint) but no donor answers, keep asking for up to `state_wait_s` (a donor may be
    restarting), rather than start a second swarm. A lone island restarting from its checkpoint sees only its earlier
    run's record, at that step: waiting for a donor then only cost it the whole `state_wait_s`."""
    deadline = time.monotonic() + network.state_wait_s
    waiting = False
    while True:
        others = _others(link)
        steps = [info["outer_step"] for info in others.values()]
        limit = donor_step_limit(aged_steps(others.values(), time.time()), network.announce_every)
        early = {} if on_anchor is None else {"on_anchor": on_anchor}
        state = resync.download(max_step=limit, **early)
        if state is not None:
            return state
        newest = robust_clock(steps)
        if newest <= (0 if own_step is None else own_step + 1):  # a step behind merges (discounted), catches up
            return None
        if time.monotonic() >= deadline:
            logger.warning(
                f"the run's records show {len(others)} islands (newest at outer step {newest}) but no state donor "
                f"answered in {network.state_wait_s:.0f}s; starting on our own and catching up when one answers"
            )
            return None
        if not waiting:
            logger.info(
                f"the run's records show {len(others)} islands (newest at outer step {newest}) but no state donor "
                f"answered yet; retrying for up to {network.state_wait_s:.0f}s"
            )
            waiting = True
        time.sleep(STATE_RETRY_S)  # a donor re-announces itself every declare_state_period; poll until then


def wait_for_islands(link: SwarmLink, count: int, timeout: float, stop: GracefulStop) -> None:
    """Before the first round, wait up to `timeout` until `count` islands of the run (this one included) announced."""
    if count <= 1 or link.records is None:
        return
    logger.info(f"waiting for {count} islands of the run before the first round (up to {timeout:.0f}s)")
    deadline = time.monotonic() + timeout
    while len(_others(link)) + 1 < count:
        if time.monotonic() >= deadline:
            logger.warning(f"{len(_others(link)) + 1} of {count} islands came within {timeout:.0f}s; starting anyway")
            return
        if stop.wait(STATE_RETRY_S / 4):  # records arrive through the DHT, which offers no event to await
            return


def save(config: PeerConfig, state: OuterState, trainer: LocalTrainer, *, now: bool = False) -> None:
    """Write a checkpoint of the outer state and local training, every `checkpoint_every` outer steps (or `now`)."""
    if not config.checkpoint_dir or (state.outer_step % config.checkpoint_every and not now):
        return
    with state.lock:
        snapshot = {**state.checkpoint(), **trainer.state_dict(state.outer_step)}
    # What rebuilds the model elsewhere, so `p2p-diloco export` needs nothing but the checkpoint folder.
    snapshot["model_spec"] = describe(config)
    snapshot["run_id"] = config.network.run_id
    save_checkpoint(config.checkpoint_dir, snapshot, snapshot["outer_step"])
