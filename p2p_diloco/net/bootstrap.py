"""A bootstrap node: a DHT peer that trains nothing and tells newcomers how to join."""

from __future__ import annotations

import logging
import signal
import threading

from p2p_diloco.files import write_lines_atomically
from p2p_diloco.net.dht import shutdown_dht, start_dht

logger = logging.getLogger(__name__)


def run_bootstrap(
    *,
    identity: str | None,
    host_maddrs: list[str],
    announce_maddrs: list[str],
    initial_peers: list[str],
    maddrs_file: str | None,
    run_id: str,
    timeout: float,
) -> None:
    """Serve the DHT until SIGINT/SIGTERM; print the multiaddrs and the peer command to paste."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    dht = start_dht(
        initial_peers=initial_peers,
        host_maddrs=host_maddrs,
        announce_maddrs=announce_maddrs,
        identity=identity,
        timeout=timeout,
    )
    try:
        maddrs = [str(maddr) for maddr in dht.get_visible_maddrs()]
        if maddrs_file:
            write_lines_atomically(maddrs_file, maddrs)
        print(f"bootstrap peer id: {dht.peer_id.to_base58()}", flush=True)
        for maddr in maddrs:
            print(f"MADDR {maddr}", flush=True)
        print("Start peers with:", flush=True)
        print(f"  p2p-diloco peer --initial-peers {' '.join(maddrs)} --run-id {run_id}", flush=True)
        stop.wait()
    finally:
        shutdown_dht(dht)
