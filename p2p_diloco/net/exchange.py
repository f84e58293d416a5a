"""Gossip exchange of pseudo-gradients between islands: one bounded averaging round with whichever are ready.

Islands of one run meet through DHT keys under the run id, average with whichever islands are ready (no
central server, no fixed world size), and serve their outer state to late joiners.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.averaging.control import AveragingStage
from hivemind.compression import CompressionBase, NoCompression
from hivemind.dht import DHT
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from p2p_diloco.diloco.staleness import StalenessRule
from p2p_diloco.net.averager import PseudoGradientAverager, StateProvider
from p2p_diloco.net.codecs import schema_hash_with_codec
from p2p_diloco.net.declarations import DeclarationClock
from p2p_diloco.net.departing_followers import DEADLINE_GATHER_KEY
from p2p_diloco.net.gate import Gate
from p2p_diloco.net.matchmaking_poll import DEFAULT_POLL_S
from p2p_diloco.net.parts import GATHER_KEY as PART_GATHER_KEY
from p2p_diloco.net.parts import part_bytes_per_window
from p2p_diloco.net.quiet_logs import quiet_hivemind
from p2p_diloco.net.records import PROTOCOL_VERSION
from p2p_diloco.net.state_transfer import AnchorSink
from p2p_diloco.timeouts import RESULT_MARGIN_S, STAGE_POLL_S, STEP_MARGIN_S


@dataclass
class ExchangeResult:
    """What one round of averaging gave this island."""

    merged: torch.Tensor | None
    """The group's weighted mean pseudo-gradient, or None when the round was discarded or found no partner."""
    partners: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Gathered metadata of the other islands in the group, by peer id."""
    wait_s: float = 0.0
    matchmaking_s: float = 0.0
    """Seconds from the start of the round until the group was assembled."""
    grace_window_s: float | None = None
    """The grace window this island allowed."""
    bytes_sent: float = 0.0
    bytes_recv: float = 0.0
    streams_repaired: int = 0
    """Reducers' reply streams that broke in this round and whose missing parts came over a new stream."""
    lanes: int = 0
    """Reducers this island sent its parts to over a direct lane in this round (the rest went over libp2p)."""
    error: str | None = None
    """Why the round gave no merge (no partner, a failed all-reduce...)."""


def _start_keeping_sigint(averager: PseudoGradientAverager) -> None:
    """Start the averager process. hivemind's run_in_background ignores SIGINT in the calling process (meaning
    the child to inherit it): give this process its own handler back, or Ctrl-C would stop nothing."""
    handler = signal.getsignal(signal.SIGINT)
    try:
        averager.run_in_background(await_ready=True)
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, handler)


class GossipExchange:
    """Host-side handle: average a pseudo-gradient with whichever islands of the run are ready."""

    def __init__(
        self,
        dht: DHT,
        *,
        run_id: str,
        size: int,
        state_provider: StateProvider,
        target_group_size: int,
        quorum: int,
        min_matchmaking_time: float,
        request_timeout: float,
        leader_poll_s: float = DEFAULT_POLL_S,
        allreduce_timeout: float,
        next_chunk_timeout: float,
        compression: CompressionBase | None = None,
        codec: str = "fp32",
        staleness_rule: StalenessRule | None = None,
        declare_state_period: float = 10.0,
        shutdown_timeout: float = 3.0,
        client_mode: bool = False,
        gate: Gate | None = None,
        robust_merge: str = "none",
        membership_token: Any = None,
        part_size_bytes: int | None = None,
        **averager_options: Any,
    ):
        """`averager_options` go to PseudoGradientAverager as they are (direct_lanes, direct_port, dht_walk_every)."""
        quiet_hivemind()  # before the averager process forks: its normal round failures are ours to report
        self.averager = PseudoGradientAverager(
            size,
            dht=dht,
            prefix=run_id,
            state_provider=state_provider,
            staleness_rule=staleness_rule,
            gate=gate,
            robust_merge=robust_merge,
            token=membership_token,
            leader_poll_s=leader_poll_s,
            target_group_size=target_group_size,
            min_group_size=max(2, quorum),  # hivemind starts a group of one at once: alone is our timeout path
            min_matchmaking_time=min_matchmaking_time,
            request_timeout=request_timeout,
            allreduce_timeout=allreduce_timeout,
            next_chunk_timeout=next_chunk_timeout,
            compression=compression or NoCompression(),
            declare_state_period=declare_state_period,
            shutdown_timeout=shutdown_timeout,
            client_mode=client_mode,
            start=False,
            **({"part_size_bytes": part_size_bytes} if part_size_bytes else {}),
            **averager_options,
        )
        # Matchmaking refuses islands whose schema differs, so naming the codec in it keeps codecs apart.
        self.averager.schema_hash = schema_hash_with_codec(self.averager.schema_hash, codec, PROTOCOL_VERSION)
        _start_keeping_sigint(self.averager)
        self.min_matchmaking_time, self.size, self.target_group_size = min_matchmaking_time, size, target_group_size
        self._schema_tag, self._group_target, self._priority_set_at = None, target_group_size, float("-inf")
        self._part_bytes, self._declarations = None, DeclarationClock()
        self.result_timeout = allreduce_timeout + RESULT_MARGIN_S

    @property
    def peer_id(self) -> str:
        """This island's peer id."""
        return self.averager.peer_id.to_base58()

    def average(
        self,
        pseudo_gradient: torch.Tensor,
        metadata: dict[str, Any],
        *,
        weight: float,
        grace_s: float,
        timeout: float,
        schema_tag: int | None = None,
        group_target: int | None = None,
        out: torch.Tensor | None = None,
    ) -> ExchangeResult:
        """One bounded round: the group's weighted average, or merged=None if no partner came or the round failed.

        The island leads a group for `grace_s` seconds (islands that arrive meanwhile join it), or joins a group
        another island leads; `timeout` bounds the whole search when a quorum above one is required. A group this
        island leads starts as soon as it has `group_target` members (None: the configured target_group_size).
        `out`: a contiguous float32 buffer of at least the pseudo-gradient's size that receives the merge
        (`merged` is then a view of its front), for a caller that reuses one across rounds: a fresh tensor per
        round costs its pages' faults (a 40 MB one took 10-56 ms with 4 islands on 2 cores, benchmarks/link.py).
        """
        counters, start = self._counters(), time.monotonic()
        self._configure_round(schema_tag, group_target or self.target_group_size)
        values = pseudo_gradient.reshape(-1)
        if values.numel() > self.size:
            raise ValueError(f"pseudo-gradient of {values.numel()} values exceeds the exchange buffer of {self.size}")
        _check_out(out, values.numel())
        with self.averager.get_tensors() as tensors:  # a fragment travels in front; the zero tail averages to zero
            tensors[0][: values.numel()].copy_(values)
            tensors[0][values.numel() :].zero_()
        result = ExchangeResult(merged=None, grace_window_s=grace_s)
        gathered = scheduled = None
        try:
            if self._part_bytes is not None:  # how fast this island moved parts last time: sizes the group's parts
                metadata = {**metadata, PART_GATHER_KEY: self._part_bytes}
            now = get_dht_time()
            scheduled = self._declarations.schedule(now, max(grace_s, self.min_matchmaking_time))
            timeout = max(timeout, scheduled - now + STEP_MARGIN_S)
            metadata = {**metadata, DEADLINE_GATHER_KEY: now + timeout}  # a leader then knows when this island leaves
            step = dict(scheduled_time=scheduled, timeout=timeout, allow_retries=True, wait=False)
            control = self.averager.step(gather=metadata, weight=weight, **step)
            while not control.done() and control.stage != AveragingStage.RUNNING_ALLREDUCE:
                time.sleep(STAGE_POLL_S)  # the stage lives in shared memory; hivemind offers no event for it
            result.matchmaking_s = time.monotonic() - start
            gathered = control.result(timeout=self.result_timeout)
        except Exception as error:  # hivemind raises assorted errors for a failed round: all mean "discard"
            result.error = f"{type(error).__name__}: {error}"
        finally:
            if scheduled is not None:
                self._declarations.ended(scheduled, get_dht_time(), self.min_matchmaking_time, now + timeout)
        self._take_merge(result, gathered, values.numel(), out)
        result.wait_s = time.monotonic() - start
        result.bytes_sent, result.bytes_recv, result.streams_repaired, result.lanes = (
            after - before for after, before in zip(self._counters(), counters)
        )
        if result.merged is not None:
            self._part_bytes = part_bytes_per_window(result.bytes_sent, result.wait_s - result.matchmaking_s)
        return result

    def _take_merge(self, result: ExchangeResult, gathered: dict | None, numel: int, out: torch.Tensor | None) -> None:
        """Copy the group's average (into `out` if given) and partners into `result`, or say why there is none."""
        if gathered and len(gathered) > 1:
            with self.averager.get_tensors() as tensors:
                averaged = tensors[0][:numel]
                result.merged = averaged.clone() if out is None else out.view(-1)[:numel].copy_(averaged)
            ours = self.averager.peer_id
            result.partners = {peer.to_base58(): data for peer, data in gathered.items() if peer != ours}
        elif result.error is None:
            result.error = "no partner within the window"

    def _configure_round(self, schema_tag: int | None, group_target: int) -> None:
        """Tell the averager what this round matches on (a fragment) and the group size that starts at once."""
        if schema_tag != self._schema_tag:
            self.averager.set_schema_tag(schema_tag)
            self._schema_tag = schema_tag
        if group_target != self._group_target:
            self.averager.set_group_target(group_target)
            self._group_target = group_target

    def _counters(self) -> tuple[float, float, int, int]:
        """The averager's running totals: payload bytes sent and received, mended reply streams, direct lanes."""
        counters = self.averager.byte_counters
        return (*counters.read(), counters.repairs(), counters.lanes())

    def load_state(
        self,
        timeout: float,
        peers: Sequence[str] | None = None,
        *,
        shapes: Sequence[tuple[int, ...]] | None = None,
        fingerprint: str | None = None,
        max_step: int | None = None,
        on_anchor: AnchorSink | None = None,
    ) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """The outer state most of the given peers (or of the run's state donors) agree on, checked against the
        model's `shapes` and `fingerprint` and not past `max_step`; None when no donor delivers one. `on_anchor`
        gets its anchor early, unverified (`PseudoGradientAverager.load_state_from`)."""
        peer_ids = None if peers is None else [PeerID.from_base58(peer) for peer in peers]
        checks = dict(shapes=shapes, fingerprint=fingerprint, max_step=max_step)
        return self.averager.load_state_from(peer_ids, timeout, **checks, on_anchor=on_anchor)

    def set_state_priority(self, priority: float) -> None:
        """The priority hivemind declares this island's state with (client mode shares no state), at most twice per
        declare period.

        hivemind re-declares a donor (a DHT store, after a look-up of the key's nearest nodes) whenever its priority
        changes; the island's priority is its outer step, so that was one declare per round: 56 of the 206 DHT
        stores of a 4-island swarm (12 rounds, tiny model). Joiners do not rank donors by it (`state_transfer` asks
        a random few for their step and digest), so a priority half a period old costs nothing. Half, not a whole
        one: hivemind's own re-declare comes only as the last one expires, and a donor is unlisted until that store
        lands (seconds on a loaded machine, and islands that started together expire together).
        """
        now = time.monotonic()
        if self.averager.client_mode or now - self._priority_set_at < self.averager.declare_state_period / 2:
            return
        self._priority_set_at = now
        self.averager.state_sharing_priority = priority

    def shutdown(self) -> None:
        """Stop the averager process."""
        if self.averager.is_alive():
            self.averager.shutdown()


def _check_out(out: torch.Tensor | None, numel: int) -> None:
    """Refuse an `out` buffer the merge cannot be written into, before the round rather than after it."""
    if out is None:
        return
    if out.dtype != torch.float32 or not out.is_contiguous() or out.numel() < numel or out.requires_grad:
        raise ValueError(
            f"out must be a contiguous float32 tensor of at least {numel} values without grad, "
            f"got {out.dtype} {tuple(out.shape)}{'' if out.is_contiguous() else ' (not contiguous)'}"
        )
