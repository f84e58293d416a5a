"""Joining the DHT with bounded time and clear errors, and the per-run registry of model fingerprints."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hivemind.utils import get_dht_time

from p2p_diloco.config import NetworkConfig
from p2p_diloco.process import OrphanFreeDHT

logger = logging.getLogger(__name__)

# Long enough to outlive a slow round, short enough that a dead island soon stops counting.
ISLAND_ANNOUNCE_TTL = 60.0


class JoinError(RuntimeError):
    """The swarm could not be reached."""


class ModelMismatchError(RuntimeError):
    """Another island of the same run trains a different model."""


def start_dht(
    *,
    initial_peers: list[str],
    host_maddrs: list[str],
    announce_maddrs: list[str],
    identity: str | None,
    timeout: float,
) -> OrphanFreeDHT:
    """Start a DHT node (and its p2pd) that dies with this process; raise JoinError within `timeout`."""
    if identity:
        Path(identity).expanduser().parent.mkdir(parents=True, exist_ok=True)
    kwargs = {"host_maddrs": host_maddrs, "identity_path": identity}
    if announce_maddrs:
        kwargs["announce_maddrs"] = announce_maddrs
    dht = OrphanFreeDHT(initial_peers=initial_peers or None, start=False, **kwargs)
    try:
        dht.run_in_background(await_ready=True, timeout=timeout)
    except TimeoutError:
        shutdown_dht(dht)
        raise JoinError(f"could not join the DHT within {timeout:.0f}s; check --initial-peers") from None
    except Exception as error:
        shutdown_dht(dht)
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        if "failed to connect to bootstrap peers" in str(error):
            raise JoinError(
                f"could not reach any initial peer {initial_peers}: is the bootstrap running and the address right?"
            ) from None
        if "already taken" in str(error):
            raise JoinError(f"identity {identity} is already used by another running peer") from None
        raise JoinError(f"could not start the DHT node: {reason}") from None
    return dht


def join_dht(network: NetworkConfig) -> OrphanFreeDHT:
    """Start this island's DHT node from its network config."""
    return start_dht(
        initial_peers=network.initial_peers,
        host_maddrs=network.host_maddrs,
        announce_maddrs=network.announce_maddrs,
        identity=network.identity,
        timeout=network.join_timeout,
    )


def shutdown_dht(dht: OrphanFreeDHT) -> None:
    """Stop a DHT process and its p2pd, killing it if it does not stop in time."""
    try:
        if dht.is_alive():
            dht.shutdown()
            dht.join(5)
    except Exception as error:  # best effort: the process may already be gone
        logger.debug(f"dht shutdown: {error!r}")
    if dht.is_alive():
        dht.kill()


def read_swarm(dht: OrphanFreeDHT, run_id: str, timeout: float = 10.0) -> dict[str, dict[str, Any]]:
    """What every live island of the run announced: fingerprint, outer step, seconds per inner step."""
    found = dht.get(f"{run_id}.islands", latest=True, return_future=True).result(timeout=timeout)
    entries = found.value if found is not None else {}
    return {
        str(subkey): item.value
        for subkey, item in (entries or {}).items()
        if isinstance(getattr(item, "value", None), dict)
    }


def announce_island(
    dht: OrphanFreeDHT, run_id: str, peer_id: str, info: dict[str, Any], *, check: bool
) -> dict[str, dict[str, Any]]:
    """Announce this island under the run id and return the others; with check, refuse a run of another model."""
    others = {peer: data for peer, data in read_swarm(dht, run_id).items() if peer != peer_id}
    if check:
        foreign = sorted({str(data.get("fingerprint")) for data in others.values()} - {info["fingerprint"]})
        codecs = sorted({str(data.get("codec")) for data in others.values()} - {str(info.get("codec"))})
        if codecs and not foreign:
            raise ModelMismatchError(
                f"codec mismatch: run {run_id!r} exchanges pseudo-gradients as {', '.join(codecs)}, this island "
                f"uses {info.get('codec')!r}; every island of a run must use the same --codec"
            )
        if foreign:
            raise ModelMismatchError(
                f"model mismatch: run {run_id!r} already trains model {', '.join(foreign)}, this island's model "
                f"is {info['fingerprint']}; use the swarm's [model] config or another --run-id"
            )
    dht.store(
        f"{run_id}.islands",
        subkey=peer_id,
        value=info,
        expiration_time=get_dht_time() + ISLAND_ANNOUNCE_TTL,
        return_future=True,
    ).result(timeout=30)
    return others
