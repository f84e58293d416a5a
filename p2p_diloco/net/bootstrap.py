"""A bootstrap node: a DHT peer that trains nothing, relays for islands behind NATs, and tells newcomers how to join."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from hivemind.utils import get_dht_time

from p2p_diloco.files import write_lines_atomically
from p2p_diloco.net.connectivity import serve_hello
from p2p_diloco.net.dht import OrphanFreeDHT, shutdown_dht, start_dht
from p2p_diloco.net.identity import ensure_identity, peer_id_of_identity
from p2p_diloco.net.membership import load_membership
from p2p_diloco.net.peers_file import read_peers_file, write_peers_file
from p2p_diloco.net.reachability import announce_relay, dialable, is_private, relay_hosts
from p2p_diloco.net.records import PROTOCOL_VERSION, RUNS_KEY, records_key, verified
from p2p_diloco.net.relay import RelayServer

logger = logging.getLogger(__name__)

REFRESH_S = 20.0
"""How often a bootstrap re-announces its relay and rewrites its peers file."""


def advice(maddrs: list[str], announced: bool) -> str | None:
    """A warning when the addresses a bootstrap prints cannot work from outside its own network."""
    if announced or not maddrs or not all(is_private(m) for m in maddrs):
        return None
    port = next((m.split("/tcp/")[1].split("/")[0] for m in maddrs if "/tcp/" in m), "PORT")
    return (
        f"every address of this bootstrap is private ({', '.join(sorted({m.split('/')[2] for m in maddrs}))}): "
        f"islands outside this network cannot reach it; pass --announce-maddrs /ip4/<public IP>/tcp/{port}"
    )


def live_peers(dht: OrphanFreeDHT, timeout: float = 10.0) -> list[str]:
    """Multiaddrs of islands the run records show, across every run registered in the DHT."""
    found = dht.get(RUNS_KEY, latest=True, return_future=True).result(timeout=timeout)
    maddrs: list[str] = []
    for run_id in list(((found.value if found is not None else None) or {}).keys())[:16]:
        islands = dht.get(records_key(str(run_id)), latest=True, return_future=True).result(timeout=timeout)
        now = get_dht_time()
        for subkey, item in ((islands.value if islands is not None else None) or {}).items():
            value, expiration = getattr(item, "value", None), getattr(item, "expiration_time", 0.0)
            if verified(subkey, value, expiration, now) is None:
                maddrs += [m for m in value["maddrs"][:2] if "/p2p/" in m]
    return list(dict.fromkeys(maddrs))


def _refresh(dht: OrphanFreeDHT, peer_id: str, relay: RelayServer | None, maddrs: list[str], peers_file: Any) -> None:
    try:
        if relay is not None:
            announce_relay(dht, peer_id, relay.port, relay_hosts(maddrs), relays=relay.serves_reservations)
        if peers_file:
            write_peers_file(peers_file, live_peers(dht))
    except Exception as error:  # a slow DHT only delays the next refresh
        logger.debug(f"bootstrap refresh: {error!r}")


def run_bootstrap(
    *,
    identity: str | None,
    host_maddrs: list[str],
    announce_maddrs: list[str],
    initial_peers: list[str],
    maddrs_file: str | None,
    run_id: str,
    timeout: float,
    relay: bool = True,
    relay_port: int = 0,
    relay_max_islands: int = 64,
    peers_file: str | None = None,
    swarm_public_key: str | None = None,
    membership: str | None = None,
) -> None:
    """Serve the DHT (and a relay) until SIGINT/SIGTERM; print the multiaddrs and the peer command to paste."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    remembered = [m for m in read_peers_file(peers_file) if m not in initial_peers]
    identity = ensure_identity(identity)
    member = None
    if swarm_public_key:
        member = load_membership(swarm_public_key, membership, None, peer_id_of_identity(identity), run_id)
    dht = start_dht(
        initial_peers=initial_peers + remembered,
        host_maddrs=host_maddrs,
        announce_maddrs=announce_maddrs,
        identity=identity,
        timeout=timeout,
        membership=member,
    )
    serve_hello(dht, {"private": member is not None, "owner": swarm_public_key, "protocol": PROTOCOL_VERSION})
    server = None
    try:
        peer_id = dht.peer_id.to_base58()
        maddrs = dialable([str(maddr) for maddr in dht.get_visible_maddrs()])
        if maddrs_file:
            write_lines_atomically(maddrs_file, maddrs)
        # It answers reachability probes even when it does not relay.
        server = RelayServer(port=relay_port, reservations=relay, max_islands=relay_max_islands).start()
        _refresh(dht, peer_id, server, maddrs, None)
        print(f"bootstrap peer id: {peer_id}", flush=True)
        for maddr in maddrs:
            print(f"MADDR {maddr}", flush=True)
        what = "relay for islands behind NATs" if relay else "reachability probes (not relaying)"
        print(f"{what} on TCP port {server.port}", flush=True)
        if (warning := advice(maddrs, bool(announce_maddrs))) is not None:
            logger.warning(warning)
        print("Start peers with:", flush=True)
        print(f"  p2p-diloco peer --initial-peers {' '.join(maddrs)} --run-id {run_id}", flush=True)
        while not stop.wait(REFRESH_S):
            _refresh(dht, peer_id, server, maddrs, peers_file)
    finally:
        if server is not None:
            server.stop()
        shutdown_dht(dht)
