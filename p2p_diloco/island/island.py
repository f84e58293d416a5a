"""One island's loop: H inner steps, a gossip exchange of the pseudo-gradient, an outer step, a record.

The island composes its collaborators and reads top to bottom, one round at a time (`Island._round`): inner steps,
land an overlapped exchange, where the swarm is, its contribution, exchange or catch up, evaluate and record.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from hivemind.utils import get_dht_time

from p2p_diloco.config import PeerConfig
from p2p_diloco.diloco.error_feedback import ErrorFeedback
from p2p_diloco.diloco.expected_group import ExpectedPartners, group_target
from p2p_diloco.diloco.fragments import Fragment, fragment_for_step, fragment_layout
from p2p_diloco.diloco.grace import GraceWindow
from p2p_diloco.diloco.merge import is_finite
from p2p_diloco.diloco.outer import pseudo_gradient
from p2p_diloco.diloco.staleness import StalenessRule, SwarmClock
from p2p_diloco.island.announce import AnnounceSchedule, SwarmViewMixin, fold_partner_steps
from p2p_diloco.island.catch_up import CatchUpMixin
from p2p_diloco.island.checkpoints import restore, save, wait_for_islands
from p2p_diloco.island.contribution import Contribution, round_metadata
from p2p_diloco.island.early_anchor import EarlyRestoreMixin
from p2p_diloco.island.link import Joining, SwarmLink, connect, solo_link
from p2p_diloco.island.outer_state import OuterState
from p2p_diloco.island.progress import Progress, history_rounds, startup_times
from p2p_diloco.island.records import progress_line, round_record
from p2p_diloco.island.resync import Resync
from p2p_diloco.island.rounds import Landed, PendingMerge, RoundOutcome, Verdict, done, in_background, nothing_landed
from p2p_diloco.island.trainer import LocalTrainer, run_fingerprint
from p2p_diloco.net.exchange import ExchangeResult
from p2p_diloco.signals import GracefulStop
from p2p_diloco.timeouts import SEARCH_MARGIN_S
from p2p_diloco.train.metrics import MetricsWriter
from p2p_diloco.train.model import count_parameters
from p2p_diloco.train.trackers import trackers

logger = logging.getLogger(__name__)

Connector = Callable[..., SwarmLink]
"""Makes the island's SwarmLink (`p2p_diloco.island.link.connect`, or a fake one in tests)."""


class Island(SwarmViewMixin, CatchUpMixin, EarlyRestoreMixin):
    """A peer that trains with DiLoCo and merges pseudo-gradients with the swarm."""

    def __init__(
        self,
        config: PeerConfig,
        *,
        connector: Connector = connect,
        stop: GracefulStop | None = None,
        trainer: LocalTrainer | None = None,
        joining: Joining | None = None,
        took_over: float | None = None,
    ):
        self.config = config
        self.took_over = took_over  # a standby's takeover (time.monotonic()): its start-up is counted from there
        self.connector, self.joining = connector, joining  # joining: a DHT node launched before the model is built
        self.stop = stop or GracefulStop()
        torch.set_num_threads(config.train.threads)
        self.trainer = trainer or LocalTrainer(config)
        self.fingerprint = run_fingerprint(self.trainer.model, config, self.trainer.data.tokenizer)
        train, network = config.train, config.network
        self.state = OuterState.for_run(self.trainer.weights(), config, self.fingerprint)
        self.fragments: list[Fragment] = fragment_layout(self.trainer.model, train.fragments, train.fragment_layout)
        self.error_feedback = ErrorFeedback.per_fragment([f.number for f in self.fragments], network)
        self.grace = GraceWindow.for_network(network)
        self.expected = ExpectedPartners(network.expect_rounds)
        self.staleness_rule = StalenessRule(network.max_staleness, network.staleness_discount)
        self.link = SwarmLink(peer_id="")
        self.resync: Resync | None = None
        self.swarm_view: dict[str, dict[str, Any]] = {}
        """What the other islands of the run announced as of the last announce, with partners' steps since."""
        self.announces = AnnounceSchedule(network.announce_every, network.announce_ttl / 3)
        self.pending: PendingMerge | None = None
        self.deadline: float | None = None
        self.progress = Progress(config.network.run_id, history_rounds(network.announce_every))
        """Recent rounds, announced with the island for `p2p-diloco status` and the dashboard."""
        self.clock = SwarmClock()
        self.startup: dict[str, float | None] = {"join_s": None, "anchor_s": None}
        self.departed: set[str] = set()
        """Islands that announced they were leaving and had no state to give when this island tried to catch up."""
        self.carried = (0, 0)
        """Tokens and inner steps of a round whose outer step was postponed (`OuterState.holding`)."""

    @property
    def outer_step(self) -> int:
        """This island's outer step."""
        return self.state.outer_step

    @property
    def stopping(self) -> bool:
        """True once a stop was requested (Ctrl-C or SIGTERM): the island stops at its next safe point."""
        return self.stop.requested

    @property
    def peer_id(self) -> str:
        """This island's peer id."""
        return self.link.peer_id

    # ----- joining ------------------------------------------------------------------------------------------
    def _connect(self) -> None:
        network = self.config.network
        if network.solo:
            self.link = solo_link(network, self.config.data.shard_index)
            return
        extra = len(self.trainer.tensor_sizes) if network.merge == "rda" else 0
        self.link = self.connector(
            network,
            announcement=self._announcement(),
            state_provider=self.state.for_peers,
            exchange_size=max(f.size for f in self.fragments) + extra,
            staleness_rule=self.staleness_rule,
            **({"joining": self.joining} if self.joining is not None else {}),
        )
        self.resync = Resync(self.link.exchange, self.state, timeout=network.state_timeout)

    # ----- one round ----------------------------------------------------------------------------------------
    def _round(self) -> dict[str, Any] | None:
        """One outer step: inner steps, merge (or catch up when too stale), outer step, eval; returns its record
        (None when a stop was requested during the inner steps: the round is discarded).

        With fragments, the round syncs fragment `swarm clock mod P` after H/P inner steps. With overlap τ > 0
        the exchange runs in the background: it lands τ inner steps into the next round, and this round's
        record describes the merge that landed in it.
        """
        train = self.config.train
        round_start = time.monotonic()
        planned = self.trainer.planned_steps([info.get("step_time_s") for info in self.swarm_view.values()])
        steps = max(1, planned // train.fragments)

        early = min(train.overlap_steps, steps) if self.pending is not None else 0  # the exchange in flight lands
        first = self.trainer.train(early, should_stop=lambda: self.stopping)
        landed = self._land() if self.pending is not None and not self.stopping else None
        rest = self.trainer.train(steps - early, should_stop=lambda: self.stopping)
        if self.stopping:
            return None
        if self.restoring is not None and not self._finish_restore():
            return self._round()  # it trained on an anchor the verified state does not hold: again, from that
        losses, tokens, compute_s = first.losses + rest.losses, first.tokens + rest.tokens, first.seconds + rest.seconds
        ready = get_dht_time()

        # Where the swarm is. An island that fell behind syncs the fragment of the swarm's clock (its
        # contribution discounted by the staleness rule) and takes the group's clock when it resyncs it.
        if self.link.online and train.overlap_steps == 0:
            self._announce(scheduled=True)  # with overlap the exchange thread announces, off the training thread
        swarm_step = self._update_clock(compute_s)
        staleness = swarm_step - self.outer_step
        fragment = self.fragments[fragment_for_step(swarm_step, train.fragments)]

        # This island's contribution; too stale to merge, it catches up instead.
        carried_tokens, carried_steps = self.carried  # the progress of a postponed round rides along
        self.carried = (0, 0)
        pace = self.clock.pace_s or compute_s
        contribution = self._contribution(
            fragment, tokens + carried_tokens, steps + carried_steps, staleness, ready, pace
        )
        if self.link.online and self.staleness_rule.factor(staleness) is None:
            landed = self._catch_up(staleness, swarm_step, contribution)
        elif train.overlap_steps == 0:  # blocking: exchange in this thread and land at once
            verdict = self._exchange(contribution, compute_s, ready)
            self.pending = PendingMerge(contribution, staleness, swarm_step, done(verdict))
            landed = self._land()
        else:
            future = in_background(self._exchange, contribution, compute_s, ready)
            self.pending = PendingMerge(contribution, staleness, swarm_step, future)
        return self._record(landed, losses, steps, compute_s, round_start)

    def _contribution(
        self, fragment: Fragment, tokens: int, steps: int, staleness: int, ready: float, round_s: float
    ) -> Contribution:
        """This round's pseudo-gradient of `fragment` with the metadata its partners weigh it by."""
        network = self.config.network
        delta = fragment.take(pseudo_gradient(self.state.anchor, self.trainer.weights())).cpu()  # the wire is on CPU
        if not is_finite(delta):
            logger.warning("local training produced NaN/inf; dropping this round's local progress")
            delta = torch.zeros_like(delta)
        metadata = round_metadata(
            fragment=fragment.label,
            outer_step=self.outer_step,
            swarm_step=self.outer_step + staleness,
            digest=self.state.digest(fragment),
            fingerprint=self.fingerprint,
            network=network,
            tokens=tokens,
            steps=steps,
            ready=ready,
            round_s=round_s,
            membership=None if self.link.membership is None else self.link.membership.token,
        )
        return Contribution(
            delta,
            fragment,
            metadata,
            peer_id=self.peer_id,
            merge_rule=network.merge,
            codec=network.codec,
            staleness_rule=self.staleness_rule,
            feedback=None if self.error_feedback is None else self.error_feedback[fragment.number],
            topk_density=network.topk_density,
        )

    def _exchange(self, contribution: Contribution, compute_s: float, ready: float) -> Verdict:
        """Average with ready partners (in this thread, or the exchange thread with overlap) and judge the result."""
        network, overlapped = self.config.network, self.config.train.overlap_steps > 0
        expected = (
            self.expected.expected(self.swarm_view, self.peer_id, self.link.connected()) if self.link.online else 1
        )
        self.state.round_in_flight(may_merge=expected != 1, pinger=self.link.pinger(self.expected.partners))
        if overlapped and self.link.online:
            self._announce(scheduled=True)
        if not self.link.online:
            return Verdict(ExchangeResult(merged=None), contribution.compensated, merged=False, note="solo")
        grace = self._round_grace(self.grace.current())
        timeout = network.averaging_timeout if network.quorum > 1 else grace + SEARCH_MARGIN_S
        if self.deadline is not None:  # never wait for a quorum past the time budget
            timeout = max(grace + SEARCH_MARGIN_S, min(timeout, self.deadline - time.monotonic()))
        result = self.link.exchange.average(
            contribution.payload(),
            contribution.metadata,
            weight=contribution.offered_weight,
            grace_s=grace,
            timeout=timeout,
            schema_tag=contribution.fragment.label,
            group_target=group_target(expected, network.quorum, network.target_group_size),
            out=self.link.merge_buffer(),
        )
        self.link.probe(self.expected.observe(result.partners, time.time()))
        fold_partner_steps(self.swarm_view, result.partners)
        if not result.partners or (expected is not None and len(result.partners) + 1 < expected):
            # Short of the expected group, the round waited out its window: read whether the missing island left
            # (one announce costs far less than another window) or who came instead.
            self.announces.hurry()
        alive = any(peer != self.peer_id for peer in self.swarm_view)
        delays = [data.get("ready", ready) - ready for data in result.partners.values()]
        self.grace.observe(delays, compute_s, missed=alive and not result.partners)
        verdict = contribution.judge(result)
        if overlapped and self.link.transport is not None:  # read the TCP counters off the training thread too
            verdict = Verdict(**{**verdict.__dict__, "transport": self.link.transport.read()})
        return verdict

    def _postponing(self) -> bool:
        """Whether to postpone an outer step taken alone (a peer is downloading our state); never the run's last."""
        return self.outer_step + 1 < self.config.train.outer_steps and self.state.holding(self.clock.pace_s or 0.0)

    def _land(self) -> Landed:
        """Wait for the exchange in flight (timed as overlap wait), then apply its outer update."""
        pending, self.pending = self.pending, None
        contribution = pending.contribution
        fragment = contribution.fragment
        mix = self.config.train.mix_alpha if self.config.train.overlap_steps > 0 else None
        wait_start = time.monotonic()
        verdict: Verdict = pending.future.result()
        blocked_s = time.monotonic() - wait_start
        exchange_s = verdict.result.wait_s
        if verdict.stale_by is not None:  # the group found this island too stale: catch up
            staleness, swarm_step = verdict.stale_by, self.outer_step + verdict.stale_by
            resync_start = time.monotonic()
            outcome = self._reject_stale(staleness, contribution)
            exchange_s += time.monotonic() - resync_start
            verdict = Verdict(verdict.result, None, merged=False, weights=verdict.weights)
        elif not verdict.merged and self._postponing():
            contribution.postpone()  # a newcomer is downloading our state: a step alone would leave it stale
            self.carried = (int(contribution.metadata["tokens"]), int(contribution.metadata["steps"]))
            note = f"outer step postponed: a peer is downloading this island's state ({verdict.note or 'alone'})"
            outcome = RoundOutcome(0, False, False, note)
            staleness, swarm_step = pending.staleness, pending.swarm_step
        else:
            self.state.step(verdict.update, fragment)
            self.trainer.load(self.state.anchor, fragment, mix)
            resynced = False
            if verdict.merged:
                self.state.release()
                resync_start = time.monotonic()
                resynced = self.resync.realign(verdict.partners, contribution.pre_digest, verdict.update, fragment)
                if resynced:
                    self.trainer.load(self.state.anchor, fragment, mix)
                exchange_s += time.monotonic() - resync_start
                blocked_s += time.monotonic() - resync_start
            outcome = RoundOutcome(len(verdict.partners), verdict.merged, resynced, verdict.note)
            staleness, swarm_step = pending.staleness, pending.swarm_step
        self.state.round_landed()
        if self.link.online:
            self.link.exchange.set_state_priority(float(self.outer_step))
        blocked_s = blocked_s if mix is not None else exchange_s
        return Landed(verdict, outcome, fragment.label, blocked_s, exchange_s, staleness, swarm_step)

    def _record(
        self, landed: Landed | None, losses: list[float], steps: int, compute_s: float, round_start: float
    ) -> dict[str, Any]:
        """Evaluate (every eval_every outer steps and at the last), then the metrics line of one round."""
        eval_start = time.monotonic()
        last = self.outer_step + (self.pending is not None) >= self.config.train.outer_steps
        eval_loss = self.trainer.evaluate() if last or self.outer_step % self.config.train.eval_every == 0 else None
        eval_s = time.monotonic() - eval_start
        landed = landed or nothing_landed("first exchange in flight")  # with overlap, round 1 lands nothing
        transport = landed.verdict.transport
        if transport is None and self.link.transport is not None and self.config.train.overlap_steps == 0:
            transport = self.link.transport.read()
        record = round_record(
            peer_id=self.peer_id,
            run_id=self.config.network.run_id,
            outer_step=self.outer_step,
            inner_steps_total=self.trainer.inner_steps_total,
            tokens=self.trainer.tokens,
            landed=landed,
            losses=losses,
            steps=steps,
            compute_s=compute_s,
            round_start=round_start,
            anchor_digest=self.state.digest(),
            transport=transport,
        )
        record.update(eval_loss=eval_loss, eval_s=eval_s, round_s=time.monotonic() - round_start)
        record.update(self.trainer.resources())
        return record

    # ----- the whole run ------------------------------------------------------------------------------------
    def run(self) -> int:
        """Train until the swarm's outer step reaches train.outer_steps; returns the number of rounds run."""
        config = self.config
        metrics = MetricsWriter(config.metrics, trackers(config.tensorboard, config.wandb))
        finished = False  # an island that failed has nothing in flight worth lingering for
        try:
            connecting = time.monotonic()
            self._connect()
            self.trainer.open_stream(self.peer_id)
            self.restore_clock = (connecting, time.monotonic())
            restored = restore(self.config, self.state, self.trainer, self.link)
            self.restoring, start_digest = restored.pending, restored.digest
            if self.restoring is None:
                self.startup = startup_times(*self.restore_clock, self.link.join_s, self.took_over)
            logger.info(
                f"island {self.peer_id} joined run {config.network.run_id!r} in {self.link.join_s:.1f}s; "
                f"{count_parameters(self.trainer.model):,} parameters on {self.trainer.device} "
                f"({self.trainer.precision.name}), {self.trainer.shard}, starting from {restored.origin} "
                f"(outer step {restored.outer_step}, anchor {start_digest})"
            )
            start_step, rounds = restored.outer_step, 0
            budget = config.train.time_budget_s
            self.deadline = time.monotonic() + budget if budget else None
            if self.link.online:
                wait_for_islands(self.link, config.network.wait_for_islands, config.network.state_wait_s, self.stop)
                if self.restoring is None:  # else once the state is in (`_finish_restore`)
                    self._announce()
            record: dict[str, Any] | None = {}
            with self.stop.deferred():
                while self.outer_step + (self.pending is not None) < config.train.outer_steps and not self.stopping:
                    if self.deadline is not None and time.monotonic() >= self.deadline:
                        logger.info(f"time budget of {budget:.0f}s used up")
                        break
                    record = self._round()
                    if record is None:
                        break
                    self._log_round(metrics, record, start_digest if rounds == 0 else None, start_step)
                    rounds += 1
            if self.link.online:
                # The final state, for `status` and newcomers; `leaving` tells the others not to wait for this island.
                self._announce(leaving=True)
            if self.stopping:
                self.pending = None  # an exchange in flight is discarded; the last checkpoint stays consistent
                save(config, self.state, self.trainer, now=True)
                logger.info(f"stopped by {self.stop.name} at outer step {self.outer_step}")
                return rounds
            if self.pending is not None:  # the last fragment's exchange is still in flight: land it
                self._log_round(
                    metrics, self._record(self._land(), [record["loss"]], 0, 0.0, time.monotonic()), None, start_step
                )
                rounds += 1
            finished = True
            return rounds
        finally:
            metrics.close()
            self.link.close(linger=finished and not self.stopping)

    def _log_round(
        self, metrics: MetricsWriter, record: dict[str, Any], start_digest: str | None, start_step: int
    ) -> None:
        """Write one round's metrics, checkpoint, and log a progress line."""
        record.update(
            start_digest=start_digest,
            start_outer_step=start_step,
            **(self.startup if start_digest is not None else dict.fromkeys(self.startup)),
        )
        metrics.write(record)
        self.progress.add(record)
        if (warning := self.progress.cut_off(record, self.link, self.swarm_view)) is not None:
            logger.warning(warning)
        save(self.config, self.state, self.trainer)
        logger.info(progress_line(record, self.config.train.outer_steps))
