"""Joining the DHT with bounded time and clear errors, in a DHT process (and p2pd) that dies with its island."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hivemind

from p2p_diloco.config import NetworkConfig
from p2p_diloco.errors import NetworkUnreachableError
from p2p_diloco.process import die_with_parent
from p2p_diloco.timeouts import DHT_STOP_S

logger = logging.getLogger(__name__)


class JoinError(NetworkUnreachableError):
    """The swarm could not be reached, or this node could not start."""


def _exec_with_parent_death(original: Callable[..., Any]) -> Callable[..., Any]:
    async def create_subprocess_exec(*args: Any, **kwargs: Any) -> Any:
        user_preexec = kwargs.pop("preexec_fn", None)

        def preexec() -> None:
            die_with_parent()
            if user_preexec is not None:
                user_preexec()

        return await original(*args, preexec_fn=preexec, **kwargs)

    return create_subprocess_exec


class OrphanFreeDHT(hivemind.DHT):
    """hivemind.DHT whose process, and the p2pd daemon it starts, die when the owning process dies."""

    def run(self) -> None:
        """Serve the DHT after arranging to die with the parent process."""
        die_with_parent()
        # hivemind starts p2pd from inside this process through asyncio and offers no hook for the child's
        # setup: wrapping asyncio's exec (in this forked process only) makes p2pd die with us too.
        asyncio.subprocess.create_subprocess_exec = _exec_with_parent_death(asyncio.subprocess.create_subprocess_exec)
        super().run()


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
            dht.join(DHT_STOP_S)
    except Exception as error:  # best effort: the process may already be gone
        logger.debug(f"dht shutdown: {error!r}")
    if dht.is_alive():
        dht.kill()
