"""An island's link to the swarm: its DHT node, the run's records, the averaging exchange and the TCP meter."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from p2p_diloco.config import NetworkConfig
from p2p_diloco.diloco.staleness import StalenessRule
from p2p_diloco.net.averager import StateProvider
from p2p_diloco.net.codecs import get_compression
from p2p_diloco.net.dht import OrphanFreeDHT, join_dht, shutdown_dht
from p2p_diloco.net.exchange import GossipExchange
from p2p_diloco.net.records import RunRecords
from p2p_diloco.net.transport import TransportMeter

logger = logging.getLogger(__name__)


@dataclass
class SwarmLink:
    """What an island talks to the swarm through; all None for an island that trains alone (`solo`)."""

    peer_id: str
    join_s: float = 0.0
    dht: OrphanFreeDHT | None = None
    records: RunRecords | None = None
    exchange: GossipExchange | None = None
    transport: TransportMeter | None = None

    @property
    def online(self) -> bool:
        """True when the island averages with a swarm."""
        return self.exchange is not None

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


def solo_link(network: NetworkConfig, shard_index: int | None) -> SwarmLink:
    """The link of an island that trains alone: no network at all."""
    return SwarmLink(peer_id=f"solo-{network.run_id}-{shard_index}")


def connect(
    network: NetworkConfig,
    *,
    announcement: dict[str, Any],
    state_provider: StateProvider,
    exchange_size: int,
    staleness_rule: StalenessRule,
) -> SwarmLink:
    """Join the DHT, announce this island (refusing a run of another model or codec), start the exchange."""
    start = time.monotonic()
    # Before any fork: the int8 codec loads bitsandbytes, which the averager process must inherit.
    compression = get_compression(network.codec)
    dht = join_dht(network)
    link = SwarmLink(peer_id=dht.peer_id.to_base58(), dht=dht)
    try:
        link.records = RunRecords(
            dht, network.run_id, link.peer_id, ttl=network.announce_ttl, timeout=network.dht_timeout
        )
        link.records.announce(announcement, check=True)
        link.exchange = GossipExchange(
            dht,
            run_id=network.run_id,
            size=exchange_size,
            state_provider=state_provider,
            target_group_size=network.target_group_size,
            quorum=network.quorum,
            min_matchmaking_time=network.min_matchmaking_time,
            request_timeout=network.request_timeout,
            allreduce_timeout=network.allreduce_timeout,
            next_chunk_timeout=network.next_chunk_timeout,
            compression=compression,
            codec=network.codec,
            staleness_rule=staleness_rule,
            declare_state_period=network.declare_state_period,
            shutdown_timeout=network.shutdown_timeout,
        )
        link.transport = TransportMeter()
        link.transport.read()
    except BaseException:
        link.close()
        raise
    link.join_s = time.monotonic() - start
    return link
