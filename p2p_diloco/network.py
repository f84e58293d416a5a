"""Joining the DHT with bounded time and clear errors, and the per-run registry of model fingerprints."""

from __future__ import annotations

import logging
from pathlib import Path

from hivemind.utils import get_dht_time

from p2p_diloco.config import NetworkConfig
from p2p_diloco.process import OrphanFreeDHT

logger = logging.getLogger(__name__)

MODEL_REGISTRY_TTL = 120.0


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


def register_model(dht: OrphanFreeDHT, run_id: str, peer_id: str, fingerprint: str, *, check: bool) -> None:
    """Announce this island's model under the run id; with check, refuse to join a run training another model."""
    key = f"{run_id}.models"
    if check:
        found = dht.get(key, latest=True, return_future=True).result(timeout=30)
        entries = found.value if found is not None else {}
        others = {
            subkey: item.value
            for subkey, item in (entries or {}).items()
            if subkey != peer_id and getattr(item, "value", None) is not None
        }
        foreign = sorted({value for value in others.values() if value != fingerprint})
        if foreign:
            raise ModelMismatchError(
                f"model mismatch: run {run_id!r} already trains model {', '.join(foreign)}, this island's model "
                f"is {fingerprint}; use the swarm's [model] config or another --run-id"
            )
    dht.store(
        key,
        subkey=peer_id,
        value=fingerprint,
        expiration_time=get_dht_time() + MODEL_REGISTRY_TTL,
        return_future=True,
    ).result(timeout=30)
