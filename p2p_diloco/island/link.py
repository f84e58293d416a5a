"""An island's link to the swarm: its DHT node, reachability, the run's records, the exchange and the TCP meter."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.utils import get_dht_time

from p2p_diloco.config import NetworkConfig
from p2p_diloco.diloco.staleness import StalenessRule
from p2p_diloco.net.averager import StateProvider
from p2p_diloco.net.codecs import get_compression
from p2p_diloco.net.connectivity import (
    ask_hello,
    connect_peers,
    connected_peers,
    ping_peers,
    probe_peers,
    revoke_in_dht,
    routing_table_size,
    serve_hello,
)
from p2p_diloco.net.dht import JoinError, OrphanFreeDHT, await_dht, launch_island_dht, shutdown_dht
from p2p_diloco.net.exchange import GossipExchange
from p2p_diloco.net.gate import Gate
from p2p_diloco.net.identity import ensure_identity, peer_id_of_identity
from p2p_diloco.net.membership import Membership, MembershipError, load_membership, read_json
from p2p_diloco.net.peers_file import read_peers_file, write_peers_file
from p2p_diloco.net.reachability import Reachability, announce_relay, determine, relay_hosts
from p2p_diloco.net.records import PROTOCOL_VERSION, RunRecords
from p2p_diloco.net.replica import ReplicaFirstDHT
from p2p_diloco.net.transport import TransportMeter
from p2p_diloco.timeouts import LINGER_S

logger = logging.getLogger(__name__)

PROBE_S = 1.0
"""How long a probed island has to answer a DHT ping (an island under a 0.4-core quota answers in milliseconds)."""
PROBE_MARGIN_S = 0.5
"""How much longer than PROBE_S the DHT process may take to report a probe."""
REVOCATIONS_KEY = "p2p-diloco.revocations"
"""DHT key where the members of a private swarm pass the owner's newest revocation list on."""


@dataclass
class SwarmLink:
    """What an island talks to the swarm through; all None for an island that trains alone (`solo`)."""

    peer_id: str
    join_s: float = 0.0
    dht: OrphanFreeDHT | None = None
    records: RunRecords | None = None
    exchange: GossipExchange | None = None
    transport: TransportMeter | None = None
    reachability: Reachability | None = None
    network: NetworkConfig | None = None
    membership: Membership | None = None
    revocations: dict | None = None
    """The newest owner-signed revocation list this island knows (from --revoked or the DHT)."""
    last_rebootstrap: float = field(default_factory=time.monotonic)
    merge_out: torch.Tensor | None = None
    """The buffer every round's merge lands in (`merge_buffer`)."""
    probing: tuple[list[str], Any, float] | None = None
    """The probe under way: its peers, the future of those that answered, when it started (monotonic)."""
    silent_peers: set[str] = field(default_factory=set)
    """The peers that did not answer the latest finished probe."""
    missing: set[str] = field(default_factory=set)
    """The recent partners missing from the last round (the latest `probe`'s peers)."""

    def merge_buffer(self) -> torch.Tensor | None:
        """Where the exchange writes each round's merge (`GossipExchange.average`'s `out`), one buffer for every
        round: the island applies a round's merge before it starts the next exchange, and a fresh tensor per
        round cost page faults on the round's critical path."""
        if self.exchange is None:
            return None
        if self.merge_out is None:
            self.merge_out = torch.empty(self.exchange.size, dtype=torch.float32)
        return self.merge_out

    @property
    def online(self) -> bool:
        """True when the island averages with a swarm."""
        return self.exchange is not None

    def connected(self) -> set[str] | None:
        """The peers connected to this island now; None where that cannot be told in time (then nobody is ruled out)."""
        if self.dht is None:
            return None
        try:
            return connected_peers(self.dht) - self.silent()
        except Exception as error:  # a busy DHT process must not hold up the round
            logger.debug(f"could not list connected peers: {error!r}")
            return None

    def probe(self, peers: list[str]) -> None:
        """Ping `peers` (recent partners missing from the last round) in the background, for `connected` to leave
        out those that did not answer: a frozen island's connections stay open, and its partners waited out their
        whole window for it for 3 rounds (benchmarks/chaos.py)."""
        self.missing = set(peers)
        self.silent_peers &= self.missing  # an island back in a group is not silent any more
        self._harvest(wait=False)
        if self.dht is None or not peers or self.probing is not None:  # one probe at a time
            return
        try:
            self.probing = (list(peers), probe_peers(self.dht, list(peers), PROBE_S), time.monotonic())
        except Exception as error:  # a busy DHT process: the peers stay expected, as without a probe
            logger.debug(f"could not probe {peers}: {error!r}")

    def pinger(self, peers: set[str]) -> Callable[[], Any] | None:
        """A call that starts a ping of `peers` (a future of those that answered within PROBE_S); None without any."""
        if self.dht is None or not peers:
            return None
        dht, targets = self.dht, sorted(peers)
        return lambda: probe_peers(dht, targets, PROBE_S)

    def silent(self) -> set[str]:
        """The peers that did not answer the latest probe, waiting out one under way (at most PROBE_S from its
        start: a frozen island costs that, not the whole window)."""
        self._harvest(wait=True)
        return set(self.silent_peers)

    def _harvest(self, wait: bool) -> None:
        if self.probing is None:
            return
        peers, future, started = self.probing
        try:
            answered = future.result(timeout=max(0.0, started + PROBE_S + PROBE_MARGIN_S - time.monotonic()) * wait)
        except TimeoutError:
            if started + PROBE_S + PROBE_MARGIN_S > time.monotonic():
                return  # still under way
            answered = set(peers)  # a DHT process too busy to report: nobody is ruled out
        except Exception:
            answered = set(peers)
        self.probing = None
        silent = (set(peers) - answered) & self.missing  # a probe that ends after its peer came back is stale
        if silent - self.silent_peers:
            logger.info(f"islands that missed the last round and answer no ping (frozen?): {sorted(silent)}")
        self.silent_peers = silent

    def refresh(self, swarm_view: dict[str, dict[str, Any]]) -> None:
        """Dial islands of the run that are reachable only through a relay; now and then re-ping initial peers."""
        if self.dht is None:
            return
        relayed = {
            peer: [m for m in info.get("maddrs") or [] if isinstance(m, str)][:4]
            for peer, info in swarm_view.items()
            if info.get("reachability") == "relayed"
        }
        if relayed:
            try:
                dialed = connect_peers(self.dht, relayed)
                if dialed:
                    logger.debug(f"dialed islands behind relays: {dialed}")
            except Exception as error:  # a slow DHT process must not stop training
                logger.debug(f"could not dial relayed islands: {error!r}")
        if time.monotonic() - self.last_rebootstrap >= self.network.rebootstrap_s:
            self.last_rebootstrap = time.monotonic()
            self._rebootstrap(swarm_view)

    def _rebootstrap(self, swarm_view: dict[str, dict[str, Any]]) -> None:
        network = self.network
        try:
            ping_peers(self.dht, network.initial_peers)
        except Exception as error:
            logger.debug(f"could not ping the initial peers: {error!r}")
        reachability = self.reachability
        if reachability is not None and reachability.relay_server is not None:
            dht = self.records.dht if self.records is not None else self.dht  # replica-first, as the records
            announce_relay(dht, self.peer_id, reachability.relay_server.port, relay_hosts(reachability.maddrs))
        if network.peers_file:
            maddrs = [m for info in swarm_view.values() for m in (info.get("maddrs") or [])[:2]]
            write_peers_file(network.peers_file, maddrs + list(network.initial_peers))
        if self.membership is not None:
            try:
                self._share_revocations()
            except Exception as error:  # revocations travel again at the next refresh
                logger.debug(f"could not share revocations: {error!r}")

    def _share_revocations(self) -> None:
        """Publish our revocation list and take a newer one from the DHT (lists are owner-signed, so anyone may
        pass one on), applying it to the DHT's and the averager's access control."""
        newest = self.revocations
        found = self.dht.get(REVOCATIONS_KEY, latest=True, return_future=True).result(timeout=self.network.dht_timeout)
        for item in ((found.value if found is not None else None) or {}).values():
            document = getattr(item, "value", None)
            if self.membership.issued(document) > self.membership.issued(newest):
                newest = document
        if newest is None:
            return
        if newest is not self.revocations:
            self.revocations = newest
            self.membership = self.membership.with_revocations(newest)
            revoke_in_dht(self.dht, newest)
            self.exchange.averager.revoke(newest)
            logger.info(f"applied a revocation list of {len(newest['revoked']['peer_ids'])} peers")
        self.dht.store(
            REVOCATIONS_KEY,
            subkey=self.peer_id,
            value=newest,
            expiration_time=get_dht_time() + self.network.announce_ttl,
        )

    def close(self, linger: bool = False) -> None:
        """Stop the averager, the relay and the DHT, leaving no child process behind.

        With `linger`, first give replies still in flight to partners of the last round time to leave.
        """
        if linger and self.exchange is not None:
            time.sleep(LINGER_S)
        if self.exchange is not None:
            try:
                self.exchange.shutdown()
            except Exception as error:  # shutting down must not mask the original error
                logger.debug(f"averager shutdown: {error!r}")
            self.exchange = None
        if self.reachability is not None:
            self.reachability.close()
            self.reachability = None
        if self.dht is not None:
            shutdown_dht(self.dht)
            self.dht = None


def check_admission(dht: OrphanFreeDHT, network: NetworkConfig, membership: Membership | None, peer_id: str) -> None:
    """Tell others whether this swarm is private; and if the initial peers refused our DHT pings, say why."""
    serve_hello(
        dht, {"private": membership is not None, "owner": network.swarm_public_key, "protocol": PROTOCOL_VERSION}
    )
    if not network.initial_peers or routing_table_size(dht) > 0:
        return
    answers = ask_hello(dht, network.initial_peers)
    private = [answer for answer in answers if answer.get("private")]
    if private and membership is None:
        owner = private[0].get("owner")
        raise MembershipError(
            f"this swarm is private (owner key {owner}): ask its owner for a membership token for peer id {peer_id} "
            f"and pass --swarm-public-key {owner} --membership TOKEN --identity <the identity it was issued for>"
        )
    if private:
        raise MembershipError(
            "the swarm's peers refused this island's membership token (expired, revoked, or for "
            "another owner key?); ask the swarm's owner for a new one"
        )
    raise JoinError(
        f"the initial peers {network.initial_peers} do not answer DHT requests; are they p2p-diloco "
        "peers of a compatible version?"
    )


def private_membership(network: NetworkConfig) -> Membership | None:
    """This island's checked membership of a private swarm (None for a public swarm)."""
    if not network.swarm_public_key:
        return None
    peer_id = peer_id_of_identity(network.identity)
    return load_membership(network.swarm_public_key, network.membership, network.revoked, peer_id, network.run_id)


def resolved_robust_merge(network: NetworkConfig) -> str:
    """--robust-merge, with 'auto' made concrete: CenteredClip among strangers, none among members."""
    if network.robust_merge != "auto":
        return network.robust_merge
    return "none" if network.swarm_public_key else "clip"


def solo_link(network: NetworkConfig, shard_index: int | None) -> SwarmLink:
    """The link of an island that trains alone: no network at all."""
    return SwarmLink(peer_id=f"solo-{network.run_id}-{shard_index}")


def _log_reachability(reachability: Reachability, run_id: str) -> None:
    """Say how others reach this island and, when they can, the command that joins through it."""
    logger.info(reachability.line)
    for warning in reachability.warnings:
        logger.warning(warning)
    if reachability.maddrs:
        logger.info(f"this island's multiaddrs: {' '.join(reachability.maddrs)}")
        logger.info(
            f"others can join through it: p2p-diloco peer --initial-peers {reachability.maddrs[0]} --run-id {run_id}"
        )


def network_exchange(
    dht: OrphanFreeDHT,
    network: NetworkConfig,
    membership: Membership | None,
    *,
    size: int,
    state_provider: StateProvider,
    client_mode: bool,
    **options: Any,
) -> GossipExchange:
    """The exchange of the run in `network`, admitting only members of a private swarm and unbanned peers."""
    return GossipExchange(
        dht,
        run_id=network.run_id,
        size=size,
        state_provider=state_provider,
        target_group_size=network.target_group_size,
        quorum=network.quorum,
        min_matchmaking_time=network.min_matchmaking_time,
        request_timeout=network.request_timeout,
        leader_poll_s=network.leader_poll_s,
        allreduce_timeout=network.allreduce_timeout,
        next_chunk_timeout=network.next_chunk_timeout,
        codec=network.codec,
        shutdown_timeout=network.shutdown_timeout,
        client_mode=client_mode,
        gate=Gate(membership, network.ban_rounds),
        membership_token=None if membership is None else membership.token,
        direct_lanes=network.direct_lanes,
        direct_port=network.direct_port,
        uplink_mbit=network.uplink_mbit,
        dht_walk_every=network.dht_walk_every,
        **options,
    )


@dataclass
class Joining:
    """An island's DHT node launched before its model is built (`begin_join`): its process starts p2pd and
    reaches the initial peers while this one imports, builds the model and loads data; `connect` adopts it."""

    dht: OrphanFreeDHT
    membership: Membership | None
    adopted: bool = False

    def abandon(self) -> None:
        """Stop the node unless `connect` adopted it (the island failed or was stopped before joining)."""
        if not self.adopted:
            shutdown_dht(self.dht)


def begin_join(network: NetworkConfig) -> Joining:
    """Check the membership (a bad token is a one-line error before anything starts) and launch the DHT node."""
    network.identity = ensure_identity(network.identity)
    membership = private_membership(network)
    remembered = [m for m in read_peers_file(network.peers_file) if m not in network.initial_peers]
    return Joining(launch_island_dht(network, extra_peers=remembered, membership=membership), membership)


def connect(
    network: NetworkConfig,
    *,
    announcement: dict[str, Any],
    state_provider: StateProvider,
    exchange_size: int,
    staleness_rule: StalenessRule,
    joining: Joining | None = None,
) -> SwarmLink:
    """Join the DHT (or finish `joining`), find out how others reach us, announce this island (refusing a run of
    another model, codec or protocol) and start the exchange."""
    start = time.monotonic()
    # Before the averager forks: blockwise codecs load their kernels (int8: and bitsandbytes), for it to inherit.
    compression = get_compression(network.codec, network.topk_bits)
    joining = joining or begin_join(network)
    joining.adopted = True
    dht, membership = await_dht(joining.dht, network.join_timeout), joining.membership
    link = SwarmLink(peer_id=dht.peer_id.to_base58(), dht=dht, network=network, membership=membership)
    if membership is not None and network.revoked:
        link.revocations = read_json(network.revoked, "revocation list")
    try:
        check_admission(dht, network, membership, link.peer_id)
        link.reachability = reachability = determine(dht, link.peer_id, network)
        _log_reachability(reachability, network.run_id)
        announcement.update(maddrs=reachability.maddrs[:4], reachability=reachability.mode)
        link.records = RunRecords(
            ReplicaFirstDHT(dht, network_every=network.dht_walk_every),
            network.run_id,
            link.peer_id,
            ttl=network.announce_ttl,
            timeout=network.dht_timeout,
        )
        link.refresh(link.records.announce(announcement, check=True))
        outbound_only = network.client_mode == "on" or (reachability.mode == "client" and network.client_mode == "auto")
        link.exchange = network_exchange(
            dht,
            network,
            membership,
            size=exchange_size,
            state_provider=state_provider,
            client_mode=outbound_only,
            compression=compression,
            staleness_rule=staleness_rule,
            declare_state_period=network.declare_state_period,
            robust_merge=resolved_robust_merge(network),
        )
        link.transport = TransportMeter(lanes=link.exchange.averager.byte_counters.wire)
        link.transport.read()
    except BaseException:
        link.close()
        raise
    link.join_s = time.monotonic() - start
    return link
