"""One island's training loop: H local AdamW steps, a gossip exchange of the pseudo-gradient, an outer step."""

from __future__ import annotations

import json
import logging
import threading
import time
import zlib
from concurrent.futures import Future
from dataclasses import asdict
from typing import Any

import torch
from hivemind.utils import get_dht_time

from p2p_diloco.config import PeerConfig
from p2p_diloco.diloco.fragments import Fragment, fragment_for_step, fragment_layout
from p2p_diloco.diloco.grace import GraceWindow
from p2p_diloco.diloco.lineage import canonical_lineage, donors
from p2p_diloco.diloco.merge import contribution_weight, is_finite, rda_decode, rda_encode
from p2p_diloco.diloco.outer import (
    OuterOptimizer,
    assign_parameters_,
    flatten_parameters,
    make_inner_optimizer,
    pseudo_gradient,
    state_digest,
)
from p2p_diloco.diloco.staleness import StalenessRule, group_weights
from p2p_diloco.island.rounds import Landed, PendingMerge, RoundOutcome, in_background
from p2p_diloco.net.codecs import ErrorFeedback, get_compression, round_trip
from p2p_diloco.net.dht import ModelMismatchError, announce_island, join_dht, shutdown_dht
from p2p_diloco.net.exchange import ExchangeResult, GossipExchange
from p2p_diloco.net.transport import TransportMeter
from p2p_diloco.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from p2p_diloco.train.data import BatchStream, evaluate, load_shards
from p2p_diloco.train.metrics import MetricsWriter
from p2p_diloco.train.model import build_model, count_parameters, model_fingerprint

logger = logging.getLogger(__name__)


def run_fingerprint(model: torch.nn.Module, config: PeerConfig) -> str:
    """Identifies what islands must share: parameter names and shapes, the model config, the exchange schema."""
    schema = "rda" if config.network.merge == "rda" else "flat"
    text = model_fingerprint(model) + json.dumps(asdict(config.model), sort_keys=True) + schema
    return f"{zlib.crc32(text.encode()):08x}{model_fingerprint(model)[:8]}"


def data_seed(seed: int, shard_index: int | None, peer_id: str) -> int:
    """Batch-order seed: fixed by (seed, shard) when the shard is given, else unique to the peer."""
    if shard_index is not None:
        return seed * 1_000_003 + shard_index + 1
    return seed * 1_000_003 + zlib.crc32(peer_id.encode())


class Island:
    """A peer that trains with DiLoCo and merges pseudo-gradients with the swarm."""

    def __init__(self, config: PeerConfig):
        self.config = config
        self._lock = threading.Lock()  # guards the outer state while a peer downloads it
        self.outer_step = 0
        self.inner_steps_total = 0
        self.tokens = 0
        self.dht = None
        self.exchange: GossipExchange | None = None
        self.deadline: float | None = None
        self.step_time_s: float | None = None
        self.fragments: list[Fragment] | None = None
        self.error_feedback: dict[int | None, ErrorFeedback] | None = None
        self.pending: PendingMerge | None = None
        self.transport: TransportMeter | None = None

    # ----- state served to and loaded from peers -------------------------------------------------------
    def _state_for_peers(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        with self._lock:
            tensors = [tensor.clone() for tensor in self._outer_tensors()]
            step = self.outer_step
        metadata = {
            "outer_step": step,
            "fingerprint": self.fingerprint,
            "digest": state_digest(*tensors),
            "run_id": self.config.network.run_id,
        }
        return metadata, tensors

    def _load_outer(self, tensors: list[torch.Tensor], outer_step: int) -> None:
        """Replace the outer state (caller holds the lock)."""
        anchor, momentum, *rest = tensors
        self.outer.load(anchor, momentum)
        every = self.outer.momentum_every
        if every > 1:
            self.outer.pending_count = outer_step % every
            self.outer.pending = rest[0].clone() if rest and self.outer.pending_count else None
        self.outer_step = outer_step

    def _adopt_state(self, metadata: dict[str, Any], tensors: list[torch.Tensor], source: str) -> None:
        if metadata.get("fingerprint") != self.fingerprint:
            raise ModelMismatchError(
                f"model mismatch: {source} of run {self.config.network.run_id!r} trains model "
                f"{metadata.get('fingerprint')}, this island's is {self.fingerprint}; "
                "use the same [model] config as the swarm or another --run-id"
            )
        with self._lock:
            self._load_outer(tensors, int(metadata["outer_step"]))
        assign_parameters_(self.model.parameters(), self.outer.anchor.data)

    # ----- setup -------------------------------------------------------------------------------------
    def _build(self) -> None:
        config = self.config
        torch.set_num_threads(config.train.threads)
        self.shards = load_shards(config.data)
        self.model = build_model(config.model, seed=config.train.seed)
        self.fingerprint = run_fingerprint(self.model, config)
        self.outer = OuterOptimizer(
            flatten_parameters(self.model.parameters()),
            lr=config.train.outer_lr,
            momentum=config.train.outer_momentum,
            momentum_every=config.train.momentum_every,
        )
        self.tensor_sizes = [parameter.numel() for parameter in self.model.parameters()]
        network = config.network
        self.grace = GraceWindow(
            mode=network.grace,
            initial_s=network.grace_s,
            min_s=network.min_matchmaking_time,
            max_s=network.grace_max_s,
            gamma=network.grace_gamma,
        )
        self.staleness_rule = StalenessRule(network.max_staleness, network.staleness_discount)
        if config.train.fragments > 1:
            self.fragments = fragment_layout(self.model, config.train.fragments)
        self.error_feedback = {} if network.error_feedback else None
        self.inner_optimizer, self.scheduler = make_inner_optimizer(
            self.model, config.train.lr, config.train.weight_decay, config.train.warmup_steps
        )

    def _start_network(self) -> None:
        network = self.config.network
        start = time.monotonic()
        if network.solo:
            self.peer_id, self.join_s = f"solo-{network.run_id}-{self.config.data.shard_index}", 0.0
            return
        # Before any fork: the int8 codec loads bitsandbytes, which the averager process must inherit.
        compression = get_compression(network.codec)
        self.dht = join_dht(network)
        self.peer_id = self.dht.peer_id.to_base58()
        self._announce(check=True)
        extra = len(self.tensor_sizes) if network.merge == "rda" else 0
        largest = self.outer.anchor.numel() if self.fragments is None else max(f.size for f in self.fragments)
        self.exchange = GossipExchange(
            self.dht,
            run_id=network.run_id,
            size=largest + extra,
            state_provider=self._state_for_peers,
            target_group_size=network.target_group_size,
            quorum=network.quorum,
            min_matchmaking_time=network.min_matchmaking_time,
            request_timeout=network.request_timeout,
            allreduce_timeout=network.allreduce_timeout,
            next_chunk_timeout=network.next_chunk_timeout,
            compression=compression,
            codec=network.codec,
            staleness_rule=self.staleness_rule,
        )
        self.transport = TransportMeter()
        self.transport.read()
        self.join_s = time.monotonic() - start

    def _restore(self) -> str:
        """Start from the freshest of: the swarm's current state, this island's checkpoint, a fresh init."""
        config = self.config
        checkpoint = None
        if config.checkpoint_dir and (path := latest_checkpoint(config.checkpoint_dir)) is not None:
            checkpoint = load_checkpoint(path)
            if checkpoint.get("fingerprint") != self.fingerprint:
                raise ModelMismatchError(
                    f"model mismatch: checkpoint {path} holds model {checkpoint.get('fingerprint')}, "
                    f"the config builds {self.fingerprint}; point --checkpoint-dir elsewhere"
                )
        swarm = None if self.exchange is None else self.exchange.load_state(timeout=config.network.state_timeout)
        swarm_step = int(swarm[0]["outer_step"]) if swarm else -1
        if checkpoint is not None:
            self._load_local(checkpoint)
        if swarm is not None and swarm_step >= self.outer_step and swarm_step > 0:
            self._adopt_state(*swarm, source="the swarm")
            return f"swarm state at outer step {swarm_step}"
        if checkpoint is not None:
            return f"checkpoint at outer step {self.outer_step}"
        return "fresh initialisation"

    def _load_local(self, checkpoint: dict[str, Any]) -> None:
        with self._lock:
            self._load_outer(checkpoint["outer_tensors"], int(checkpoint["outer_step"]))
        assign_parameters_(self.model.parameters(), self.outer.anchor.data)
        self.inner_optimizer.load_state_dict(checkpoint["inner_optimizer"])
        self.scheduler.load_state_dict(checkpoint["scheduler"])
        self.stream.load_state_dict(checkpoint["stream"])
        self.inner_steps_total = int(checkpoint["inner_steps_total"])
        self.tokens = int(checkpoint["tokens"])

    def _save(self) -> None:
        config = self.config
        if not config.checkpoint_dir or self.outer_step % config.checkpoint_every:
            return
        with self._lock:
            state = {
                "anchor": self.outer.anchor.data.clone(),
                "outer_tensors": [tensor.clone() for tensor in self._outer_tensors()],
                "outer_step": self.outer_step,
                "fingerprint": self.fingerprint,
                "inner_optimizer": self.inner_optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "stream": self.stream.state_dict(),
                "inner_steps_total": self.inner_steps_total,
                "tokens": self.tokens,
            }
        save_checkpoint(config.checkpoint_dir, state, self.outer_step)

    # ----- training ----------------------------------------------------------------------------------
    def _announce(self, *, check: bool) -> dict[str, dict[str, Any]]:
        """Tell the run who we are and where we are; returns what the other islands announced."""
        info = {
            "fingerprint": self.fingerprint,
            "codec": self.config.network.codec,
            "outer_step": self.outer_step,
            "step_time_s": self.step_time_s,
        }
        try:
            self._swarm_view = announce_island(self.dht, self.config.network.run_id, self.peer_id, info, check=check)
        except ModelMismatchError:
            raise
        except Exception as error:  # a slow or restarting DHT must not stop training: use the last view
            logger.warning(f"could not reach the DHT to announce this island ({error!r}); using the last view")
        return getattr(self, "_swarm_view", {})

    def _planned_inner_steps(self, swarm: dict[str, dict[str, Any]]) -> int:
        """H, or with dynamic local updates floor(speed / fastest speed * H) so slow islands arrive with the rest."""
        steps = self.config.train.inner_steps
        if not self.config.train.dynamic_steps or not self.step_time_s:
            return steps
        times = [info["step_time_s"] for info in swarm.values() if info.get("step_time_s")] + [self.step_time_s]
        return max(1, int(steps * min(times) / self.step_time_s))

    def _inner_steps(self, steps: int) -> tuple[list[float], int]:
        """Run `steps` local AdamW steps; returns their losses and the tokens they consumed."""
        config = self.config
        if steps <= 0:
            return [], 0
        self.model.train()
        losses = []
        start = time.monotonic()
        for _ in range(steps):
            step_start = time.monotonic()
            inputs, targets = self.stream.next_batch()
            _, loss = self.model(inputs, targets)
            self.inner_optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if config.train.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.train.grad_clip)
            self.inner_optimizer.step()
            self.scheduler.step()
            losses.append(loss.item())
            if config.train.slowdown > 1:  # emulate slower hardware for heterogeneity experiments
                time.sleep((config.train.slowdown - 1) * (time.monotonic() - step_start))
        self.step_time_s = (time.monotonic() - start) / steps
        self.inner_steps_total += steps
        self.tokens += steps * self.stream.tokens_per_batch
        return losses, steps * self.stream.tokens_per_batch

    def _merge(
        self,
        delta: torch.Tensor,
        fragment: int | None,
        tokens: int,
        steps: int,
        staleness: int,
        ready: float,
        compute_s: float,
    ) -> tuple[torch.Tensor, ExchangeResult, RoundOutcome]:
        """Average with ready partners; fall back to the island's own pseudo-gradient when that fails."""
        network = self.config.network
        if self.exchange is None:
            return delta, ExchangeResult(merged=None), RoundOutcome(0, False, False, "solo")
        base_weight = contribution_weight(network.merge, tokens, steps)
        weight = base_weight * (self.staleness_rule.factor(staleness) or 0.0)
        with self._lock:
            digest = state_digest(*self._outer_tensors(fragment))
        tensor_sizes = self.tensor_sizes if fragment is None else self.fragments[fragment].tensor_sizes
        if self.error_feedback is not None:  # carry last round's quantization residual of this fragment
            delta = self.error_feedback.setdefault(fragment, ErrorFeedback()).compensate(delta)
        metadata = {
            "fragment": fragment,
            "outer_step": self.outer_step,
            "swarm_step": self.outer_step + staleness,
            "digest": digest,
            "fingerprint": self.fingerprint,
            "codec": network.codec,
            "tokens": tokens,
            "steps": steps,
            "base_weight": base_weight,
            "ready": ready,
        }
        payload = rda_encode(delta, tensor_sizes) if network.merge == "rda" else delta
        grace = self.grace.current()
        timeout = network.averaging_timeout if network.quorum > 1 else grace + 0.5
        if self.deadline is not None:  # never wait for a quorum past the time budget
            timeout = max(grace + 0.5, min(timeout, self.deadline - time.monotonic()))
        result = self.exchange.average(
            payload, metadata, weight=weight, grace_s=grace, timeout=timeout, schema_tag=fragment
        )
        result.grace_window_s, result.own_weight = grace, weight
        alive = any(peer != self.peer_id for peer in getattr(self, "_swarm_view", {}))
        delays = [data.get("ready", ready) - ready for data in result.partners.values()]
        self.grace.observe(delays, compute_s, missed=alive and not result.partners)
        note = result.error
        merged = result.merged
        if merged is not None:
            members = {self.peer_id: metadata, **result.partners}
            try:
                weights = group_weights(members, self.staleness_rule)
            except (KeyError, TypeError, ValueError):
                weights = {}  # an island of another kind: the mismatch check below discards the round
            result.own_weight = weights.get(self.peer_id, weight)
            for peer, data in result.partners.items():
                data["weight"] = weights.get(peer)
            group_clock = max(int(m.get("swarm_step", m.get("outer_step", 0))) for m in members.values())
            if weights.get(self.peer_id) == 0.0:
                # Our view of the swarm was older than the group's (e.g. we were stalled): the group has
                # already given our contribution weight 0, so catch up instead of applying its merge.
                return delta, result, RoundOutcome(0, False, False, None, stale_by=group_clock - self.outer_step)
            strangers = [
                p
                for p, data in result.partners.items()
                if data.get("fingerprint") != self.fingerprint or data.get("codec") != network.codec
            ]
            if strangers:
                note = f"model or codec mismatch: discarded a round with islands of another kind: {strangers}"
                logger.warning(note)
                merged = None
            elif not is_finite(merged):
                note = "NaN or inf in the merged update from a peer: round discarded"
                logger.warning(note)
                merged = None
            elif network.merge == "rda":
                merged = rda_decode(merged, tensor_sizes)
        if self.error_feedback is not None:
            feedback = self.error_feedback[fragment]
            if merged is None:  # the island applies its own full-precision update: nothing was lost
                feedback.clear()
            else:
                feedback.update(round_trip(network.codec, delta), delta)
        if merged is None:
            result.partners = {}
            return delta, result, RoundOutcome(0, False, False, note)
        return merged, result, RoundOutcome(len(result.partners), True, False, None)

    def _outer_tensors(self, fragment: int | None = None) -> list[torch.Tensor]:
        """The outer state that islands on one lineage share bit for bit (of one fragment, if given)."""
        if fragment is not None:
            index = self.fragments[fragment].index
            return [self.outer.anchor.data[index], self.outer.momentum()[index]]
        tensors = [self.outer.anchor.data, self.outer.momentum()]
        if self.outer.momentum_every > 1:
            pending = self.outer.pending
            tensors += [torch.zeros_like(self.outer.anchor.data) if pending is None else pending]
        return tensors

    def _catch_up(self, staleness: int) -> str:
        """A contribution too stale to merge: drop local progress and download the swarm's current state."""
        state = self.exchange.load_state(timeout=self.config.network.state_timeout)
        if state is None or int(state[0]["outer_step"]) <= self.outer_step:
            return f"{staleness} steps stale and no newer donor answered"
        self._adopt_state(*state, source="a donor")
        return f"{staleness} steps stale: contribution rejected, resynced to outer step {self.outer_step}"

    def _reject_stale(self, staleness: int, delta: torch.Tensor, fragment: int | None) -> RoundOutcome:
        """Drop a too-stale contribution and catch up; with no newer donor, apply it alone and go on."""
        if self.error_feedback is not None:
            self.error_feedback.clear()
        outcome = RoundOutcome(0, False, True, self._catch_up(staleness))
        if not outcome.note.startswith(f"{staleness} steps stale:"):
            outcome.resynced = False
            self._apply(delta, fragment, mix=False)
        return outcome

    def _resync_if_off_lineage(
        self, result: ExchangeResult, merged: torch.Tensor, pre_digest: str, fragment: int | None
    ) -> bool:
        """After a merge, an island whose (fragment's) outer state differs from the group's canonical one fetches it."""
        members = {self.peer_id: (self.outer_step - 1, pre_digest)}
        members.update({peer: (int(d["outer_step"]), str(d["digest"])) for peer, d in result.partners.items()})
        canonical = canonical_lineage(members)
        if members[self.peer_id] == canonical:
            return False
        peers = donors(members, canonical)
        state = self.exchange.load_state(timeout=self.config.network.state_timeout, peers=peers)
        if state is None:
            logger.warning("off the group's lineage and no donor answered; keeping own anchor")
            return False
        metadata, tensors = state
        if metadata.get("fingerprint") != self.fingerprint:
            return False
        if fragment is not None:
            index = self.fragments[fragment].index
            donor = [tensors[0][index], tensors[1][index]]
            with self._lock:
                self.outer.anchor.data[index] = donor[0]
                state = self.outer.optimizer.state[self.outer.anchor]
                state.setdefault("momentum_buffer", torch.zeros_like(self.outer.anchor.data))[index] = donor[1]
                if state_digest(*donor) == canonical[1]:  # donor had not applied this round yet
                    self.outer.step_fragment(merged, index)
                # Take the group's clock too, so this island syncs the same fragments as the group from now on
                # (a P-step lag would otherwise keep matching the same fragment, forever behind).
                self.outer_step = canonical[0] + 1
        elif metadata.get("digest") == canonical[1]:  # donor had not applied this round yet
            with self._lock:
                self._load_outer(tensors, canonical[0])
                self.outer.step(merged)
                self.outer_step = canonical[0] + 1
        else:
            with self._lock:
                self._load_outer(tensors, int(metadata["outer_step"]))
        logger.info(f"resynchronised anchor from {peers[0][:12]}... at outer step {self.outer_step}")
        return True

    def _apply(self, update: torch.Tensor, fragment: int | None, mix: bool) -> None:
        """Outer step with a merged pseudo-gradient on the whole model or one fragment, then refresh the weights.

        Without overlap the fragment's weights become the new anchor; with overlap the local steps taken while
        the exchange ran are kept by mixing: θ ← α·θ_local + (1 − α)·θ_anchor (Streaming DiLoCo).
        """
        with self._lock:
            if fragment is None:
                self.outer.step(update)
            else:
                self.outer.step_fragment(update, self.fragments[fragment].index)
            self.outer_step += 1
        self._refresh_weights(fragment, mix)

    def _refresh_weights(self, fragment: int | None, mix: bool) -> None:
        """Load the anchor (of one fragment, mixed with the local weights if `mix`) into the model."""
        anchor = self.outer.anchor.data
        if fragment is None and not mix:
            assign_parameters_(self.model.parameters(), anchor)
            return
        local = flatten_parameters(self.model.parameters())
        index = slice(None) if fragment is None else self.fragments[fragment].index
        if mix:
            alpha = self.config.train.mix_alpha
            local[index] = local[index].mul_(alpha).add_(anchor[index], alpha=1.0 - alpha)
        else:
            local[index] = anchor[index]
        assign_parameters_(self.model.parameters(), local)

    def _round(self, swarm: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """One outer step: inner steps, merge (or catch up when too stale), outer step, eval; returns its record.

        With fragments, the round syncs fragment `outer_step mod P` after H/P inner steps. With overlap τ > 0
        the exchange runs in the background: it lands τ inner steps into the next round, and this round's
        record describes the merge that landed in it.
        """
        config = self.config
        round_start = time.monotonic()
        steps = max(1, self._planned_inner_steps(swarm) // config.train.fragments)
        early = min(config.train.overlap_steps, steps) if self.pending is not None else 0
        losses, tokens = self._inner_steps(early)
        compute_s = time.monotonic() - round_start
        landed = self._land() if self.pending is not None else None
        rest_start = time.monotonic()
        more_losses, more_tokens = self._inner_steps(steps - early)
        losses, tokens = losses + more_losses, tokens + more_tokens
        compute_s += time.monotonic() - rest_start
        ready = get_dht_time()
        overlap = config.train.overlap_steps > 0
        if self.dht is None:
            swarm = {}
        elif overlap:  # announced by the last exchange, off the training thread; the group rule backs it up
            swarm = getattr(self, "_swarm_view", {})
        else:
            swarm = self._announce(check=False)
        swarm_step = max([self.outer_step] + [int(info.get("outer_step", 0)) for info in swarm.values()])
        staleness = swarm_step - self.outer_step
        # The fragment follows the swarm's clock: an island that fell behind syncs what the others sync (its
        # contribution discounted by the staleness rule) and takes their clock when it resyncs that fragment.
        fragment = None if self.fragments is None else fragment_for_step(swarm_step, config.train.fragments)
        delta = pseudo_gradient(self.outer.anchor.data, flatten_parameters(self.model.parameters()))
        if fragment is not None:
            delta = delta[self.fragments[fragment].index]
        if not is_finite(delta):
            logger.warning("local training produced NaN/inf; dropping this round's local progress")
            delta = torch.zeros_like(delta)
        with self._lock:
            pre_digest = state_digest(*self._outer_tensors(fragment))
        if self.exchange is not None and self.staleness_rule.factor(staleness) is None:
            wait_start = time.monotonic()
            outcome = self._reject_stale(staleness, delta, fragment)
            waited = time.monotonic() - wait_start
            landed = Landed(ExchangeResult(merged=None, wait_s=waited), outcome, fragment, waited)
            landed.staleness, landed.swarm_step = staleness, swarm_step
        else:
            pending = PendingMerge(fragment, pre_digest, delta, staleness, swarm_step)
            merge_args = (delta, fragment, tokens, steps, staleness, ready, compute_s)
            if config.train.overlap_steps == 0:  # blocking: exchange in this thread, land at once
                pending.future = Future()
                pending.future.set_result(self._merge(*merge_args))
                self.pending = pending
                landed = self._land()
            else:
                pending.future = in_background(self._announce_and_merge, *merge_args)
                self.pending = pending
        eval_start = time.monotonic()
        eval_loss = self._evaluate()
        record = self._record(landed, losses, steps, compute_s, round_start)
        record["eval_loss"], record["eval_s"] = eval_loss, time.monotonic() - eval_start
        record["round_s"] = time.monotonic() - round_start
        return record, swarm

    def _announce_and_merge(self, *merge_args: Any) -> tuple[torch.Tensor, ExchangeResult, RoundOutcome]:
        """The background half of an overlapped round: announce (this refreshes the swarm view), merge, and
        read the TCP counters, so that none of it costs training time."""
        if self.dht is not None:
            self._announce(check=False)
        merged, result, outcome = self._merge(*merge_args)
        result.transport = self.transport.read() if self.transport is not None else None
        return merged, result, outcome

    def _evaluate(self) -> float:
        config = self.config
        return evaluate(
            self.model, self.shards.eval, config.model.seq_len, config.train.batch_size, config.data.eval_batches
        )

    def _land(self) -> Landed:
        """Wait for the exchange in flight (timed as overlap wait), then apply its outer update."""
        pending, self.pending = self.pending, None
        wait_start = time.monotonic()
        merged, result, outcome = pending.future.result()
        blocked_s = time.monotonic() - wait_start
        fragment, staleness, swarm_step = pending.fragment, pending.staleness, pending.swarm_step
        mix = self.config.train.overlap_steps > 0
        if outcome.stale_by is not None:
            staleness, swarm_step = outcome.stale_by, self.outer_step + outcome.stale_by
            resync_start = time.monotonic()
            outcome = self._reject_stale(staleness, pending.delta, fragment)
            result.partners, result.wait_s = {}, result.wait_s + time.monotonic() - resync_start
        else:
            self._apply(merged, fragment, mix)
            if outcome.merged:
                resync_start = time.monotonic()
                outcome.resynced = self._resync_if_off_lineage(result, merged, pending.pre_digest, fragment)
                if outcome.resynced:
                    self._refresh_weights(fragment, mix)
                result.wait_s += time.monotonic() - resync_start
                blocked_s += time.monotonic() - resync_start
        if self.exchange is not None:
            self.exchange.set_state_priority(float(self.outer_step))
        landed = Landed(result, outcome, fragment, blocked_s if mix else result.wait_s)
        landed.staleness, landed.swarm_step = staleness, swarm_step
        return landed

    def _record(
        self, landed: Landed | None, losses: list[float], steps: int, compute_s: float, round_start: float
    ) -> dict[str, Any]:
        """The metrics line of one round."""
        config = self.config
        if landed is None:  # the first round with overlap: the first fragment is still in flight
            landed = Landed(
                ExchangeResult(merged=None), RoundOutcome(0, False, False, "first exchange in flight"), None
            )
        result, outcome = landed.result, landed.outcome
        with self._lock:
            digest = state_digest(*self._outer_tensors())
        partners = list(result.partners.values())
        transport = getattr(result, "transport", None)
        if transport is None and self.transport is not None and self.config.train.overlap_steps == 0:
            transport = self.transport.read()
        return {
            "peer_id": self.peer_id,
            "run_id": config.network.run_id,
            "outer_step": self.outer_step,
            "inner_steps_total": self.inner_steps_total,
            "loss": sum(losses) / len(losses),
            "tokens": self.tokens,
            "partners": outcome.partners,
            "wait_s": landed.blocked_s,
            "exchange_s": result.wait_s,
            "bytes_sent": result.bytes_sent,
            "bytes_recv": result.bytes_recv,
            "transport_sent": None if transport is None else transport[0],
            "transport_recv": None if transport is None else transport[1],
            "time": time.time(),
            "quorum": outcome.partners + 1,
            "grace_s": result.matchmaking_s,
            "grace_window_s": result.grace_window_s,
            "merge_weights": [result.own_weight] + [data.get("weight") for data in partners],
            "staleness": [landed.staleness] + [landed.swarm_step - int(data["outer_step"]) for data in partners],
            "fragment": landed.fragment,
            "inner_steps": steps,
            "compute_s": compute_s,
            "round_s": time.monotonic() - round_start,
            "group": sorted(result.partners),
            "merged": outcome.merged,
            "resynced": outcome.resynced,
            "note": outcome.note,
            "anchor_digest": digest,
        }

    def run(self) -> int:
        """Train until the swarm's outer step reaches train.outer_steps; returns the number of outer steps run."""
        config = self.config
        self._build()
        metrics = MetricsWriter(config.metrics)
        try:
            self._start_network()
            self.stream = BatchStream(
                self.shards.train_shard(config.data.shard_index or 0, config.data.num_shards)
                if config.data.shard_index is not None
                else self.shards.train,
                config.train.batch_size,
                config.model.seq_len,
                seed=data_seed(config.train.seed, config.data.shard_index, self.peer_id),
            )
            origin = self._restore()
            start_digest = state_digest(*self._outer_tensors())
            logger.info(
                f"island {self.peer_id} joined run {config.network.run_id!r} in {self.join_s:.1f}s; "
                f"{count_parameters(self.model):,} parameters, starting from {origin} "
                f"(outer step {self.outer_step}, anchor {start_digest})"
            )
            start_step, rounds = self.outer_step, 0
            budget = config.train.time_budget_s
            self.deadline = time.monotonic() + budget if budget else None
            swarm = self._announce(check=False) if self.dht is not None else {}
            while self.outer_step + (self.pending is not None) < config.train.outer_steps:
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    logger.info(f"time budget of {budget:.0f}s used up")
                    break
                record, swarm = self._round(swarm)
                self._log_round(metrics, record, start_digest if rounds == 0 else None, start_step)
                rounds += 1
            if self.pending is not None:  # the last fragment's exchange is still in flight: land it
                round_start = time.monotonic()
                record = self._record(self._land(), [record["loss"]], 0, 0.0, round_start)
                eval_start = time.monotonic()
                record["eval_loss"] = self._evaluate()
                record["eval_s"] = time.monotonic() - eval_start
                self._log_round(metrics, record, None, start_step)
                rounds += 1
            return rounds
        finally:
            self.close()

    def _log_round(
        self, metrics: MetricsWriter, record: dict[str, Any], start_digest: str | None, start_step: int
    ) -> None:
        """Write one round's metrics, checkpoint, and log a progress line."""
        record.update(
            start_digest=start_digest,
            start_outer_step=start_step,
            join_s=self.join_s if start_digest is not None else None,
        )
        metrics.write(record)
        self._save()
        logger.info(
            f"outer step {self.outer_step}/{self.config.train.outer_steps}: loss {record['loss']:.4f} "
            f"eval {record['eval_loss']:.4f} partners {record['partners']} wait {record['wait_s']:.2f}s "
            f"(grace window {record['grace_window_s'] or 0:.2f}s)"
            + ("" if record["fragment"] is None else f" fragment {record['fragment']}")
            + (f" ({record['note']})" if record["note"] else "")
        )

    def close(self) -> None:
        """Stop the averager and the DHT, leaving no child process behind."""
        if self.exchange is not None:
            try:
                self.exchange.shutdown()
            except Exception as error:  # shutting down must not mask the original error
                logger.debug(f"averager shutdown: {error!r}")
            self.exchange = None
        if self.dht is not None:
            shutdown_dht(self.dht)
            self.dht = None
