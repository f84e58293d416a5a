"""Can the world dial this island? Ask a relay to dial it back; if not, keep it reachable through the relay.

Relays (every bootstrap, and reachable islands unless `--relay off`) announce themselves under one DHT key. An
island asks one to dial back its p2pd's TCP port from outside (`p2p_diloco.net.relay.probe`): if that works, it
is reachable directly; if not, it reserves a port on the relay and announces that address instead, or, without
a relay, averages in client mode (outbound connections only). The verdict is one line in the log.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from hivemind.utils import get_dht_time

from p2p_diloco.config import NetworkConfig
from p2p_diloco.net.connectivity import split_maddr, tcp_port
from p2p_diloco.net.relay import RelayClient, RelayServer, probe

logger = logging.getLogger(__name__)

RELAYS_KEY = "p2p-diloco.relays"
"""DHT key under which relays announce {"port": control port, "hosts": [IPs]} (one subkey per relay)."""
RELAY_TTL_S = 60.0
FIND_RELAYS_S = 6.0
"""How long a starting island looks for a relay in the DHT (a bootstrap announces its relay at start)."""


def host_of(maddr: str) -> str | None:
    """The IPv4 address of a multiaddr, if it has one."""
    parts = str(maddr).split("/")
    return parts[parts.index("ip4") + 1] if "ip4" in parts else None


def is_loopback(maddr: str) -> bool:
    """True for a /ip4/127.x address."""
    host = host_of(maddr)
    return host is not None and ipaddress.ip_address(host).is_loopback


def is_private(maddr: str) -> bool:
    """True for loopback, RFC 1918 and other addresses the internet cannot route to."""
    host = host_of(maddr)
    return host is not None and not ipaddress.ip_address(host).is_global


def dialable(maddrs: list[str]) -> list[str]:
    """The addresses worth giving to others: loopback dropped unless nothing else is left, public ones first."""
    maddrs = [str(m) for m in maddrs if "p2p-circuit" not in str(m)]
    outside = [m for m in maddrs if not is_loopback(m)] or maddrs
    return sorted(outside, key=lambda m: (is_private(m), "/udp/" in m))


def announce_relay(dht: Any, peer_id: str, port: int, hosts: list[str], relays: bool = True) -> None:
    """Tell the DHT that this node answers probes (and, if `relays`, relays) on `port` at `hosts`."""
    value = {"port": port, "hosts": hosts, "relay": relays}
    dht.store(RELAYS_KEY, subkey=peer_id, value=value, expiration_time=get_dht_time() + RELAY_TTL_S)


def find_relays(
    dht: Any, *, exclude: str | None = None, timeout: float = 5.0
) -> list[tuple[str, list[str], int, bool]]:
    """(peer id, hosts, control port, relays?) of every relay announced in the DHT (well-formed records only)."""
    found = dht.get(RELAYS_KEY, latest=True, return_future=True).result(timeout=timeout)
    relays = []
    for subkey, item in ((found.value if found is not None else None) or {}).items():
        value = getattr(item, "value", None)
        if subkey == exclude or not isinstance(value, dict):
            continue
        port, hosts = value.get("port"), value.get("hosts")
        if isinstance(port, int) and 0 < port < 65536 and isinstance(hosts, list):
            hosts = [h for h in hosts if isinstance(h, str) and _is_ip(h)][:8]
            relays.append((str(subkey), hosts, port, value.get("relay") is not False))
    return relays


@dataclass
class Reachability:
    """How others reach this island, and what keeps it so."""

    mode: str
    """'direct', 'relayed', 'client' (outbound only) or 'unknown' (no relay answered a probe)."""
    maddrs: list[str]
    """Full multiaddrs others should dial, best first."""
    line: str
    """The one line that tells the user."""
    relay_client: RelayClient | None = None
    relay_server: RelayServer | None = None
    warnings: list[str] = field(default_factory=list)

    def close(self) -> None:
        """Give up the relay reservation and stop serving as a relay."""
        for part in (self.relay_client, self.relay_server):
            if part is not None:
                part.stop()


def _ordered_hosts(hosts: list[str], preferred: set[str]) -> list[str]:
    return sorted(hosts, key=lambda host: (host not in preferred, ipaddress.ip_address(host).is_loopback))


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _relays(dht: Any, peer_id: str, network: NetworkConfig) -> list[tuple[str, int, bool]]:
    """(host, port, relays?) of the relays to try, those at an initial peer's address first."""
    preferred = {host_of(split_maddr(m)[0]) for m in network.initial_peers}
    deadline = time.monotonic() + (FIND_RELAYS_S if network.initial_peers else 0.0)
    while True:
        try:
            relays = find_relays(dht, exclude=peer_id, timeout=network.dht_timeout)
        except Exception as error:  # the DHT may be slow: no relay is a verdict, not a failure
            logger.debug(f"could not read the relay list: {error!r}")
            relays = []
        if relays or time.monotonic() >= deadline:
            break
        time.sleep(0.5)  # a bootstrap announces its relay once it is up; poll the DHT until it shows
    return [(host, port, relays) for _, hosts, port, relays in relays for host in _ordered_hosts(hosts, preferred)]


def determine(dht: Any, peer_id: str, network: NetworkConfig) -> Reachability:
    """Find out how others can reach this island and arrange it (a relay reservation, a relay to serve)."""
    visible = [str(m) for m in dht.get_visible_maddrs(latest=True)]
    own = dialable(visible)
    port = tcp_port(network.announce_maddrs or own)
    relays = [] if network.relay == "off" and network.client_mode != "auto" else _relays(dht, peer_id, network)
    verdict, observed, asked = None, None, None
    for host, control, _ in relays:
        reachable, observed = probe((host, control), port) if port else (False, None)
        if observed is not None:
            verdict, asked = reachable, (host, control)
            break
    warnings = []
    if network.announce_maddrs and verdict is False:
        warnings.append(
            f"--announce-maddrs {' '.join(network.announce_maddrs)} is not reachable: a relay could not dial "
            f"TCP port {port} of {observed}; forward that port to this machine or fix the address"
        )
    if verdict and network.relay != "only":
        server = _serve_relay(dht, peer_id, network, own) if network.relay == "auto" else None
        maddrs = network.announce_maddrs or own
        return Reachability(
            "direct",
            [_full(m, peer_id) for m in maddrs],
            f"reachable at {_full(maddrs[0], peer_id)}",
            relay_server=server,
            warnings=warnings,
        )
    if network.relay != "off":
        serving = [(host, control) for host, control, relays in relays if relays]
        for relay in ([asked] if asked in serving else []) + [r for r in serving if r != asked]:
            client = _reserve(relay, peer_id, port)
            if client is not None:
                address = f"/ip4/{relay[0]}/tcp/{client.port}/p2p/{peer_id}"
                why = "relay only (--relay only)" if verdict else "not reachable from outside (behind NAT)"
                line = (
                    f"{why}: using relay {address}; to serve others, forward TCP port {port} or pass --announce-maddrs"
                )
                return Reachability(
                    "relayed",
                    [address] + [_full(m, peer_id) for m in own],
                    line,
                    relay_client=client,
                    warnings=warnings,
                )
    if verdict is None:
        line = "could not check reachability (no relay answered); assuming others can dial " + _full(own[0], peer_id)
        return Reachability("unknown", [_full(m, peer_id) for m in own], line, warnings=warnings)
    return Reachability(
        "client",
        [],
        f"not reachable from outside and no relay available: averaging in client mode "
        f"(outbound only); to serve others, forward TCP port {port} or pass --announce-maddrs",
        warnings=warnings,
    )


def _full(maddr: str, peer_id: str) -> str:
    return maddr if "/p2p/" in maddr else f"{maddr}/p2p/{peer_id}"


def _reserve(relay: tuple[str, int], peer_id: str, port: int | None) -> RelayClient | None:
    if port is None:
        return None
    client = RelayClient(relay, peer_id, port)
    try:
        client.start()
    except (OSError, TimeoutError) as error:
        logger.warning(f"relay {relay[0]}:{relay[1]} refused a reservation ({error}); trying another")
        client.stop()
        return None
    return client


def _serve_relay(dht: Any, peer_id: str, network: NetworkConfig, own: list[str]) -> RelayServer | None:
    try:
        server = RelayServer(port=network.relay_port).start()
    except OSError as error:
        logger.warning(f"could not serve as a relay on port {network.relay_port}: {error}")
        return None
    announce_relay(dht, peer_id, server.port, relay_hosts(own))
    return server


def relay_hosts(maddrs: list[str]) -> list[str]:
    """The IPs a relay is reached at, from its multiaddrs (public ones first, loopback last)."""
    hosts = []
    for maddr in dialable(maddrs) + [str(m) for m in maddrs]:
        host = host_of(maddr)
        if host and host not in hosts:
            hosts.append(host)
    return hosts
