"""Training on the swarm's anchor while the rest of its state downloads.

A newcomer's state is the anchor and the outer momentum (77 MB for 10M parameters), and its inner steps need only
the anchor: the donor sends the anchor first, the island trains its first round on it while the momentum is still
on the wire, and adopts the whole state, verified, before that round's exchange. If the verified state's anchor
is not the one it trained on (the donor failed the digest, or trained on meanwhile), the round's inner steps are
dropped and trained again from the state adopted.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from p2p_diloco.island.idle_priority import can_leave_idle_priority, set_policy
from p2p_diloco.island.outer_state import OuterState
from p2p_diloco.island.progress import startup_times
from p2p_diloco.island.rounds import in_background
from p2p_diloco.island.trainer import LocalTrainer
from p2p_diloco.net.state_transfer import AnchorSink, State

logger = logging.getLogger(__name__)


def adoptable(step: int, state: OuterState) -> bool:
    """Whether the swarm's state at outer `step` replaces `state` (a checkpoint's or a fresh init, at step 0, which
    every island of the run starts from alike)."""
    return step >= max(1, state.outer_step)


class StateDownload:
    """The swarm's state downloading in a background thread, its anchor handed over as soon as it is in."""

    def __init__(self, fetch: Callable[[AnchorSink], State | None]):
        self.started = time.monotonic()
        self.metadata: dict[str, Any] | None = None
        self.anchor: torch.Tensor | None = None
        self.anchor_s: float | None = None
        self._settled = threading.Event()  # the anchor is in, or the download ended without one
        self._future = in_background(fetch, self._take_anchor)
        self._future.add_done_callback(lambda _: self._settled.set())

    def _take_anchor(self, metadata: dict[str, Any], anchor: torch.Tensor) -> None:
        self.metadata, self.anchor, self.anchor_s = metadata, anchor, time.monotonic() - self.started
        self._settled.set()

    def early(self, state: OuterState) -> PendingRestore | None:
        """Wait for the anchor; the restore to finish later if the island can train on it now, else None."""
        self._settled.wait()
        if self.anchor is None or not adoptable(int(self.metadata["outer_step"]), state):
            return None
        self._train_at_idle_priority()
        return PendingRestore(self, self.anchor, int(self.metadata["outer_step"]), str(self.metadata["digest"]))

    def _train_at_idle_priority(self) -> None:
        """Until the download ends, the calling thread (the island's training) runs at SCHED_IDLE.

        The inner steps have until the state is in; the download has the deserializing averager process and the
        libp2p daemon, which share the cores with training: on 2 cores with a donor training beside it, training
        at normal priority stretched a 10M state's download from 7.0 s to 8.1 s (benchmarks/restart_link.py).
        Only this thread: torch's worker threads (train.threads > 1) and the threads that hand the state over from
        the averager keep their priority. Back to normal the moment the download ends, from the download's thread.
        """
        if not can_leave_idle_priority():
            return
        training = threading.get_native_id()
        set_policy([training], os.SCHED_IDLE)
        self._future.add_done_callback(lambda _: set_policy([training], os.SCHED_OTHER))

    def result(self) -> State | None:
        """The verified state (None: no donor delivered one); waits for the end of the download."""
        return self._future.result()


@dataclass
class PendingRestore:
    """An island training on a donor's anchor whose state is still downloading."""

    download: StateDownload
    anchor: torch.Tensor
    outer_step: int
    digest: str

    def finish(self, state: OuterState, trainer: LocalTrainer) -> bool:
        """Adopt the verified state; True if its anchor is the one the island trained on (else it is reloaded)."""
        swarm = self.download.result()
        if swarm is not None and adoptable(int(swarm[0]["outer_step"]), state):
            state.adopt(*swarm, source="the swarm")
        kept = swarm is not None and torch.equal(swarm[1][0], self.anchor)
        if not kept:
            logger.warning(
                f"the state downloaded is not the anchor at outer step {self.outer_step} this round trained on "
                f"(now at outer step {state.outer_step}, anchor {state.digest()}): training the round again"
            )
            trainer.load_all(state.anchor)
        return kept


class EarlyRestoreMixin:
    """Island's end of a restore that started its first round on the anchor alone."""

    restoring: PendingRestore | None = None
    restore_clock: tuple[float, float] = (0.0, 0.0)
    """When joining and restoring began (time.monotonic()), for the start-up record at the restore's end."""

    def _finish_restore(self) -> bool:
        """Adopt the downloaded state before the first exchange; False when the round must be trained again."""
        pending, self.restoring = self.restoring, None
        kept = pending.finish(self.state, self.trainer)
        self.startup = startup_times(*self.restore_clock, self.link.join_s, self.took_over, pending.download.anchor_s)
        logger.info(
            f"the rest of the swarm's state arrived {self.startup['restore_s'] - pending.download.anchor_s:.1f}s "
            f"after its anchor, while this island trained on it (outer step {self.outer_step}, anchor "
            f"{self.state.digest()})"
        )
        if self.link.online:
            self._announce()
        return kept
