"""An island's outer state behind one lock: stepped by the training loop, served to peers, saved in checkpoints."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from p2p_diloco.config import NetworkConfig, PeerConfig
from p2p_diloco.diloco.fragments import Fragment
from p2p_diloco.diloco.outer import OuterOptimizer, state_digest
from p2p_diloco.net.records import ModelMismatchError

logger = logging.getLogger(__name__)

SETTLE_WAIT_S = 10.0
"""How long a donor holds a state request while a round of its own is in flight (`OuterState.for_peers`)."""
SETTLE_MIN_BYTES = 16 << 20
"""States smaller than this are served at once: at 100 Mbit/s they cross in under 1.4 s, a round rarely lands
meanwhile, and the wait would cost more than it saves (a restart in benchmarks/chaos.py: a 0.3 MB state, probed on
four donors that are mostly in a round)."""


class OuterState:
    """Anchor, outer Nesterov momentum (and Delayed Nesterov's buffer) and the outer step of one island.

    Islands on one lineage of outer steps hold these bit for bit; a peer that joins late downloads them. The lock
    guards them against the averager process's state server, which reads them while the island trains.
    """

    def __init__(
        self,
        anchor: torch.Tensor,
        *,
        lr: float,
        momentum: float,
        momentum_every: int,
        fingerprint: str,
        run_id: str,
        hold_s: float = NetworkConfig.state_timeout,  # the asker's download deadline (`holding`)
    ):
        self.lock = threading.RLock()
        self.optimizer = OuterOptimizer(anchor, lr=lr, momentum=momentum, momentum_every=momentum_every)
        self.fingerprint, self.run_id = fingerprint, run_id
        self.outer_step = 0
        self._settled = threading.Event()
        self._settled.set()
        self._round_lock = threading.Lock()
        self._rounds = 0  # rounds begun: tells a late answer to `_round_pinger`'s ping from the current round's
        self._round_pinger: Callable[[], Any] | None = None
        self._ping: Any = None  # the latest ping of a round's partners (a future)
        self.hold_s = hold_s
        self._served_at: float | None = None
        self._hold_since = 0.0
        self._version = 0  # counts the changes to the shared tensors
        self._digested: tuple[int, str] | None = None  # (version, digest of the whole state)

    @classmethod
    def for_run(cls, anchor: torch.Tensor, config: PeerConfig, fingerprint: str) -> OuterState:
        """The outer state of a run's config, starting at `anchor`."""
        train = config.train
        return cls(
            anchor,
            lr=train.outer_lr,
            momentum=train.outer_momentum,
            momentum_every=train.momentum_every,
            fingerprint=fingerprint,
            run_id=config.network.run_id,
            hold_s=config.network.state_timeout,
        )

    @property
    def anchor(self) -> torch.Tensor:
        """The anchor weights, flat (the live tensor: read under the lock when a peer may be downloading)."""
        return self.optimizer.anchor.data

    def tensors(self, fragment: Fragment | None = None) -> list[torch.Tensor]:
        """The tensors that islands on one lineage share bit for bit (views; of one fragment, if given)."""
        optimizer = self.optimizer
        if fragment is not None and not fragment.whole:
            return [fragment.take(optimizer.anchor.data), fragment.take(optimizer.momentum())]
        tensors = [optimizer.anchor.data, optimizer.momentum()]
        if optimizer.momentum_every > 1:
            pending = optimizer.pending
            tensors.append(torch.zeros_like(optimizer.anchor.data) if pending is None else pending)
        return tensors

    def digest(self, fragment: Fragment | None = None) -> str:
        """Digest of the (fragment's) shared tensors: equal on every island of the same lineage."""
        with self.lock:
            if fragment is not None and not fragment.whole:
                return state_digest(*self.tensors(fragment))
            # Every round's record digests the whole state, and so does every peer's probe and download of it.
            if self._digested is None or self._digested[0] != self._version:
                self._digested = (self._version, state_digest(*self.tensors()))
            return self._digested[1]

    def round_in_flight(self, may_merge: bool = True, pinger: Callable[[], Any] | None = None) -> None:
        """A round's exchange began: if it may merge, its outer step lands soon and a state served before then is stale
        on arrival. A round expected alone leaves a served state current (its step is postponed, `holding`), so a
        newcomer's probe is served at once: waiting for it cost a restart over 100 Mbit/s 1.5 s of its 8.8 s restore
        (benchmarks/restart_link.py, 10M int8, two islands).

        `pinger` starts a ping of the partners the round expects: a future of the set that answered. A request that
        would wait for the round pings them first, and none answering means the round cannot merge (a partner
        killed just before it began is still expected, by its last announce, until its record is read again)."""
        with self._round_lock:
            self._rounds += 1
            self._round_pinger = pinger if may_merge else None
            if may_merge:
                self._settled.clear()

    def round_landed(self) -> None:
        """The round in flight landed (merged, alone or caught up): the state is current until the next one."""
        self._settled.set()

    def _wait_for_round(self) -> None:
        """Wait (up to SETTLE_WAIT_S) for the round in flight to land, or for its expected partners to answer no
        ping: the restarted island's probe waited out its donor's round with the incarnation it replaced (0.8 s of a
        12.6 s restart over 100 Mbit/s, benchmarks/restart_link.py)."""
        with self._round_lock:
            pinger, number = self._round_pinger, self._rounds
        if pinger is not None and not self._settled.is_set():
            try:
                # Kept: hivemind drops the answer to an MPFuture nobody holds, and the callback with it.
                self._ping = pinger()
                self._ping.add_done_callback(lambda future: self._partners_answered(future, number))
            except Exception as error:  # a busy DHT process: wait for the round as without a ping
                logger.debug(f"could not ping the round's partners: {error!r}")
        self._settled.wait(SETTLE_WAIT_S)

    def _partners_answered(self, future: Any, number: int) -> None:
        """A ping of round `number`'s partners ended: if nobody answered, that round cannot merge."""
        if future.cancelled() or future.exception() is not None or future.result():
            return
        with self._round_lock:
            if number == self._rounds and not self._settled.is_set():
                logger.info("serving the state without waiting for the round in flight: its partners answer no ping")
                self._settled.set()

    def for_peers(self, with_tensors: bool = True) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """A consistent copy of the whole state with its metadata, for a peer that joins late or resyncs (only the
        metadata, and no tensors, without `with_tensors`).

        While a round is in flight the copy of a large state (SETTLE_MIN_BYTES) waits (up to SETTLE_WAIT_S) for it
        to land: the state it would serve becomes one step old when the round lands, and a newcomer that downloads
        it (a restart over a 100 Mbit/s link takes 7 s for 77 MB) merges one step behind and downloads the whole
        state again to realign (benchmarks/restart_link.py). A few seconds' wait costs less than that download.
        """
        if 8 * self.optimizer.anchor.numel() >= SETTLE_MIN_BYTES:  # anchor and momentum, fp32
            # Within a hold, a round in flight steps only by a merge, which makes the state a step old whether the
            # request waits for it or not: only a request that starts a hold (a newcomer's probe) waits.
            if not self.holding(0.0):
                self._wait_for_round()
                self._hold_since = time.monotonic()
            self._served_at = time.monotonic()
        with self.lock:
            tensors = [tensor.to("cpu", copy=True) for tensor in self.tensors()] if with_tensors else []
            step, digest = self.outer_step, self.digest()
        metadata = {"outer_step": step, "fingerprint": self.fingerprint, "digest": digest, "run_id": self.run_id}
        return metadata, tensors

    def holding(self, round_s: float) -> bool:
        """True while a peer may still be downloading this (large) state to merge from it: served within the asker's
        download deadline and one round of `round_s`.

        An outer step taken alone meanwhile leaves the newcomer a step behind on arrival, and at a few steps (a
        305 MB state crosses 100 Mbit/s in 25 s, while the donor rounds every 2 s) it is too stale to merge and
        downloads the whole state again, over and over (benchmarks/restart_link.py: 3 second downloads). So the
        island postpones those steps and trains on: its next contribution carries the postponed progress.
        """
        if self._served_at is None:
            return False
        now = time.monotonic()
        # Requests renew a hold, but never past two deadlines: a peer that kept asking cannot stop our outer steps.
        return now - self._served_at < self.hold_s + round_s and now - self._hold_since < 2 * self.hold_s + round_s

    def release(self) -> None:
        """A merged round landed: whoever downloaded the state merged with the swarm, or no longer needs it."""
        self._served_at = None

    def load(self, tensors: list[torch.Tensor], outer_step: int) -> None:
        """Replace the whole state (from a checkpoint or a donor) and take its outer step."""
        anchor, momentum, *rest = tensors
        with self.lock:
            optimizer = self.optimizer
            optimizer.load(anchor, momentum)
            every = optimizer.momentum_every
            if every > 1:
                optimizer.pending_count = outer_step % every
                optimizer.pending = rest[0].clone() if rest and optimizer.pending_count else None
            self.outer_step = outer_step
            self._version += 1

    def load_fragment(self, fragment: Fragment, tensors: list[torch.Tensor]) -> None:
        """Replace one fragment's anchor and momentum with a donor's (from its whole state `tensors`)."""
        anchor, momentum = tensors[0], tensors[1]
        with self.lock:
            device = self.optimizer.anchor.device
            fragment.put(self.optimizer.anchor.data, fragment.take(anchor).to(device))
            state = self.optimizer.optimizer.state[self.optimizer.anchor]
            buffer = state.setdefault("momentum_buffer", torch.zeros_like(self.optimizer.anchor.data))
            fragment.put(buffer, fragment.take(momentum).to(device))
            self._version += 1

    def adopt(self, metadata: dict[str, Any], tensors: list[torch.Tensor], source: str) -> None:
        """Load a state downloaded from `source`, refusing one of another model."""
        if metadata.get("fingerprint") != self.fingerprint:
            raise ModelMismatchError(
                f"model mismatch: {source} of run {self.run_id!r} trains model "
                f"{metadata.get('fingerprint')}, this island's is {self.fingerprint}; "
                "use the same [model] config as the swarm or another --run-id"
            )
        self.load(tensors, int(metadata["outer_step"]))

    def step(self, update: torch.Tensor, fragment: Fragment) -> None:
        """One outer step with a merged pseudo-gradient, on the whole model or one fragment."""
        with self.lock:
            if fragment.whole:
                self.optimizer.step(update)
            else:
                self.optimizer.step_fragment(update, fragment.index)
            self.outer_step += 1
            self._version += 1

    def checkpoint(self) -> dict[str, Any]:
        """A consistent copy for a checkpoint."""
        with self.lock:
            return {
                "anchor": self.anchor.to("cpu", copy=True),
                "outer_tensors": [tensor.to("cpu", copy=True) for tensor in self.tensors()],
                "outer_step": self.outer_step,
                "fingerprint": self.fingerprint,
            }
