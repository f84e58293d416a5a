"""hivemind's DecentralizedAverager over one flat pseudo-gradient buffer: all-or-nothing rounds, weights by the
group's staleness rule, matchmaking by schema, and the island's outer state served to and downloaded from peers."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Sequence

# hivemind tells streaming handlers from unary ones by typing.AsyncIterator's name (not collections.abc's).
from typing import Any, AsyncIterator  # noqa: UP035

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException
from hivemind.dht import DHT
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time, get_logger
from hivemind.utils.mpfuture import MPFuture

from p2p_diloco.diloco.staleness import (
    WEIGHT_CAP,
    StalenessRule,
    group_weights,
    implausible_claims,
    own_weight,
    weight_claims_over_cap,
)
from p2p_diloco.net.allreduce import StrictAllReduceRunner
from p2p_diloco.net.counters import ByteCounters
from p2p_diloco.net.departing_followers import start_without_departing_followers
from p2p_diloco.net.direct import DirectLanes
from p2p_diloco.net.gate import Gate
from p2p_diloco.net.gathered import island_metadata
from p2p_diloco.net.join_races import join_responses
from p2p_diloco.net.matchmaking_poll import DEFAULT_POLL_S, pace_lookups
from p2p_diloco.net.parts import GATHER_KEY as PART_GATHER_KEY
from p2p_diloco.net.parts import part_size_for
from p2p_diloco.net.repair import ServedParts
from p2p_diloco.net.replica import NETWORK_EVERY, ReplicaFirstDHT, averager_walk_every
from p2p_diloco.net.round_service import RoundServiceMixin
from p2p_diloco.net.round_settings import RoundSettingsMixin
from p2p_diloco.net.shared_memory import shared_zeros
from p2p_diloco.net.state_serving import StateServingMixin
from p2p_diloco.net.withdrawals import detach_withdrawals
from p2p_diloco.process import die_with_parent, ignore_group_stop_signals, keep_freed_memory
from p2p_diloco.timeouts import AVERAGER_COMMAND_S

logger = get_logger(__name__)

StateProvider = Callable[..., tuple[dict[str, Any], Sequence[torch.Tensor]]]
"""Called with `with_tensors`: False for a peer that asks only what the state is (its tensors may then be empty)."""


class PseudoGradientAverager(StateServingMixin, RoundServiceMixin, RoundSettingsMixin, DecentralizedAverager):
    """DecentralizedAverager over one flat pseudo-gradient buffer, all-or-nothing, serving the outer state."""

    def __init__(
        self,
        size: int,
        *,
        dht: DHT,
        prefix: str,
        state_provider: StateProvider,
        staleness_rule: StalenessRule | None = None,
        gate: Gate | None = None,
        robust_merge: str = "none",
        token: Any = None,
        leader_poll_s: float = DEFAULT_POLL_S,
        direct_lanes: bool = True,
        direct_port: int = 0,
        uplink_mbit: float = 0.0,
        dht_walk_every: int = NETWORK_EVERY,
        **kwargs: Any,
    ):
        self.byte_counters = ByteCounters()
        # Lanes open sockets in the averager's own process, on first use (see _lanes).
        self._lanes_wanted = direct_lanes and DirectLanes.enabled_by_env()
        self._direct_port, self._uplink_mbit = direct_port, uplink_mbit
        self._direct_lanes: DirectLanes | None = None
        self._adaptive_parts = "part_size_bytes" not in kwargs
        self._state_provider = state_provider
        self._state_requests: mp.SimpleQueue = mp.SimpleQueue()  # per request to the host: whether tensors go too
        self._staleness_rule = staleness_rule
        self.gate = gate or Gate(None, ban_rounds=0)
        self.robust_merge = robust_merge
        self._token = token
        self._served: ServedParts | None = None  # the latest round's averaged parts, for a member that lost some
        self.leader_poll_s, self.dht_walk_every = leader_poll_s, dht_walk_every
        # Shared here, with a retry, so that hivemind's own share_memory_() finds it shared already.
        super().__init__([shared_zeros(size)], dht=dht, prefix=prefix, **kwargs)

    # hivemind caches the rpc handlers it collects per class hierarchy: without these, a process that used a plain
    # DecentralizedAverager first would serve this class with the base class's handlers.
    _rpc_handlers = None
    _stub_type = None

    def run(self) -> None:
        """Serve averaging after arranging to die with the island's process."""
        die_with_parent()
        ignore_group_stop_signals()
        keep_freed_memory()
        self.dht = ReplicaFirstDHT(self.dht, network_every=averager_walk_every(self.dht_walk_every))  # group keys
        super().run()

    async def _shutdown(self, timeout: float | None) -> None:
        if self._served is not None:  # a member of our last round may still ask for parts its reply stream lost
            # Within the parent's wait for this process (`shutdown_timeout`), less a second for the rest.
            await self._served.linger(max(0.0, (timeout or 0.0) - 1.0))
        if self._direct_lanes is not None:
            self._direct_lanes.close()
        # Overrides hivemind's private shutdown: a stop signal sent to the whole process group (systemd's default,
        # `kill -TERM -PGID`) also stops the p2pd daemon, and hivemind's unregistering of handlers then dies with a
        # traceback on the daemon's vanished socket. There is nothing left to unregister in that case.
        try:
            await super()._shutdown(timeout)
        except (OSError, ConnectionError) as error:
            logger.info(f"averager stopped after its p2p daemon ({error.__class__.__name__})")

    async def _step(self, **kwargs: Any) -> None:
        pace_lookups(self._matchmaking.group_key_manager, self.leader_poll_s)  # idempotent; Matchmaking exists now
        detach_withdrawals(self._matchmaking.group_key_manager)  # idempotent too
        start_without_departing_followers(self._matchmaking)  # and this
        await super()._step(**kwargs)

    def get_current_state(self) -> tuple[dict[str, Any], Sequence[torch.Tensor], None]:
        """The island's outer state (anchor, momentum, step...) for a peer that joins late or resyncs; only its
        metadata for a peer that asks what the state is (`rpc_state_info`)."""
        metadata, tensors = self._state_provider(with_tensors=self._state_requests.get())
        return metadata, tensors, None

    async def _get_current_state_from_host_process(self, with_tensors: bool = True):
        # Overrides hivemind's private request to the host process (its trigger carries no arguments) to say whether
        # the tensors are wanted: a probe for the state's digest copied the whole state, and moved it through shared
        # memory, to be dropped here (seconds for a 305 MB state). Flag and trigger are queued together, and hivemind's
        # fetcher thread, the only caller of get_current_state, takes one flag per trigger: they stay paired.
        future = MPFuture()
        self._state_requests.put(with_tensors)
        self._inner_pipe.send(("_TRIGGER_GET_CURRENT_STATE", future))
        return await future

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes | None = None, **kwargs
    ) -> None:
        group_id = group_info.group_id if group_id is None else group_id
        members = self._gathered(group_info)
        self.gate.next_round()
        refused = [peer for peer, data in members.items() if self.gate.admit(peer.to_base58(), data.get("membership"))]
        if refused:
            raise AllreduceException(f"group members without a valid membership token: {refused}")
        caps = self._weight_caps(members)
        if caps is not None:
            kwargs["weight"] = min(kwargs.get("weight", 1.0), caps.pop(None))
            kwargs["weight_caps"] = caps
        if self._adaptive_parts:
            rates = [data.get(PART_GATHER_KEY) for data in members.values()]
            kwargs["part_size_bytes"] = part_size_for(tensors, len(members), kwargs["compression"], rates)
        backup = self._backup_of(tensors)
        runner = StrictAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            byte_counters=self.byte_counters,
            robust_merge=self.robust_merge,
            on_dropped=self._dropped,
            lanes=self._lanes(),
            **kwargs,
        )
        self._served = runner.served  # the latest round only: a member asks for lost parts right after a round
        assert group_id in self._running_groups, f"group {group_id} was not registered"
        self._running_groups[group_id].set_result(runner)
        try:
            await runner.average_into(tensors, grace=self.next_chunk_timeout)
            if runner.failed_size:
                raise AllreduceException(f"partial all-reduce: {runner.failed_size} values were not averaged")
            if runner.poisoned:  # each part was checked as it arrived: no second pass over the whole buffer
                raise AllreduceException("partial all-reduce: a group member failed mid-round")
            await runner.wait_for_replies(timeout=self.next_chunk_timeout)
        except BaseException:
            # Never leave a half-averaged buffer behind, not even for a retry within the same step.
            for tensor, saved in zip(tensors, backup):
                tensor.copy_(saved)
            raise
        finally:
            runner.served.end_round()

    def _backup_of(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """A copy of `tensors` in buffers kept across rounds (a fresh 200 MB clone per round cost ~50k page faults)."""
        saved = getattr(self, "_backup", None)
        if saved is None or [t.shape for t in saved] != [t.shape for t in tensors]:
            saved = self._backup = [torch.empty_like(tensor) for tensor in tensors]
        for buffer, tensor in zip(saved, tensors):
            buffer.copy_(tensor)
        return saved

    def _gathered(self, group_info: GroupInfo) -> dict[PeerID, dict[str, Any]]:
        """Every member's gathered metadata (an empty dict for one that sent something else)."""
        return {peer: island_metadata(gathered) for peer, gathered in zip(group_info.peer_ids, group_info.gathered)}

    def _weight_caps(self, members: dict[PeerID, dict[str, Any]]) -> dict[PeerID | None, float] | None:
        """The most each sender may weigh (None: this island's own weight), or None without a staleness rule."""
        if self._staleness_rule is None:
            return None
        wellformed = {peer: data for peer, data in members.items() if _weighable(data)}
        if self.peer_id not in wellformed:
            return None
        bounds = group_weights(wellformed, self._staleness_rule)
        for peer, claim in implausible_claims(self.peer_id, wellformed, get_dht_time()).items():
            self.gate.warn_once(
                peer.to_base58(),
                f"claims the swarm is at step {claim}, which it cannot have reached: the claim is ignored",
                kind="clock claim",
            )
        for peer, (claimed, cap) in weight_claims_over_cap(wellformed).items():
            self.gate.warn_once(
                peer.to_base58(),
                f"declares a weight of {claimed:.3g}, above {WEIGHT_CAP:g}x the group's median: capped at {cap:.3g}",
                kind="weight claim",
            )
        caps = {peer: 0.0 if self.gate.banned(peer.to_base58()) else bounds.get(peer, 0.0) for peer in members}
        caps[None] = own_weight(self.peer_id, wellformed, self._staleness_rule, get_dht_time())
        if caps[None] == 0.0:
            logger.info("this island's contribution is too stale for the group: it sends weight 0")
        return caps

    def _dropped(self, peer: PeerID, why: str) -> None:
        if "NaN" in why:
            self.gate.ban(peer.to_base58(), why)
        else:
            logger.warning(f"island {peer} sent {why}: it counts for no more than the others")

    # ----- who may talk to this island ------------------------------------------------------------------------
    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """Refuse a follower that is banned or (in a private swarm) shows no valid token; else hivemind's."""
        peer = context.remote_id.to_base58()
        token = island_metadata(request.gather).get("membership")
        if self.gate.banned(peer) or (self.gate.private and self.gate.admit(peer, token) is not None):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        responses = super().rpc_join_group(request, context)
        async for response in join_responses(self._matchmaking, request, context.remote_id, responses):
            yield response

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Take parts only from members. A banned peer already in the group is heard but weighs 0 (its weight cap):
        refusing its stream would fail the round for every member, which is what the ban is meant to prevent."""
        if not self.gate.member(context.remote_id.to_base58()):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_aggregate_part(stream, context):
            yield response

    def revoke(self, document: Any) -> None:
        """Apply an owner-signed revocation list in the averager process too."""
        future = MPFuture()
        self._outer_pipe.send(("_revoke", [], dict(document=document, future=future)))
        future.result(timeout=AVERAGER_COMMAND_S)

    async def _revoke(self, document: Any, future: MPFuture) -> None:
        self.gate.revoke(document)
        future.set_result(True)


def _weighable(data: dict[str, Any]) -> bool:
    step, weight = data.get("outer_step"), data.get("base_weight")
    return (
        isinstance(step, int)
        and not isinstance(step, bool)
        and isinstance(data.get("swarm_step", step), int)
        and isinstance(weight, (int, float))
        and not isinstance(weight, bool)
    )
