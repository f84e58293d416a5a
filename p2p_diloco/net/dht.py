"""Joining the DHT with bounded time and clear errors, in a DHT process (and p2pd) that dies with its island."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

import hivemind

from p2p_diloco.config import NetworkConfig
from p2p_diloco.errors import NetworkUnreachableError, UserError
from p2p_diloco.net.dht_guard import MembershipAuthorizer, record_validators
from p2p_diloco.net.identity import ensure_identity, generated_here, load_identity
from p2p_diloco.net.membership import Membership
from p2p_diloco.process import die_with_parent, ignore_group_stop_signals
from p2p_diloco.timeouts import BOOTSTRAP_TIMEOUT_S, DHT_STOP_S

logger = logging.getLogger(__name__)


class JoinError(NetworkUnreachableError):
    """The swarm could not be reached, or this node could not start."""


class ListenError(UserError):
    """This node cannot listen where it was told to."""


def _exec_with_parent_death(original: Callable[..., Any]) -> Callable[..., Any]:
    async def create_subprocess_exec(*args: Any, **kwargs: Any) -> Any:
        user_preexec = kwargs.pop("preexec_fn", None)

        def preexec() -> None:
            die_with_parent()
            # Out of the island's process group: a group's SIGTERM (kill -- -PGID, a test's stop) would end p2pd at
            # once, since Go handles SIGTERM even when started with it ignored, cutting the round the island is
            # finishing before it stops. p2pd still dies with the DHT process, which dies with the island.
            os.setpgid(0, 0)
            if user_preexec is not None:
                user_preexec()

        return await original(*args, preexec_fn=preexec, **kwargs)

    return create_subprocess_exec


class OrphanFreeDHT(hivemind.DHT):
    """hivemind.DHT whose process, and the p2pd daemon it starts, die when the owning process dies."""

    def run(self) -> None:
        """Serve the DHT after arranging to die with the parent process."""
        die_with_parent()
        ignore_group_stop_signals()
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
    client_mode: bool = False,
    membership: Membership | None = None,
    rpc_timeout: float = NetworkConfig.dht_rpc_timeout,
) -> OrphanFreeDHT:
    """Start a DHT node (and its p2pd) that dies with this process; raise JoinError within `timeout`.

    The node runs with an RSA identity (`identity`, created if missing; a fresh temporary one if None) that signs
    its records; with `membership` (a private swarm) every DHT request must carry a member's token. A client-mode
    node only makes requests: nobody adds it to their routing table or dials it. One request waits `rpc_timeout`
    seconds for a reply; the first contact with the initial peers keeps hivemind's longer bootstrap wait.
    """
    dht = launch_dht(
        initial_peers=initial_peers,
        host_maddrs=host_maddrs,
        announce_maddrs=announce_maddrs,
        identity=identity,
        client_mode=client_mode,
        membership=membership,
        rpc_timeout=rpc_timeout,
    )
    return await_dht(dht, timeout)


def launch_dht(
    *,
    initial_peers: list[str],
    host_maddrs: list[str],
    announce_maddrs: list[str],
    identity: str | None,
    client_mode: bool = False,
    membership: Membership | None = None,
    rpc_timeout: float = NetworkConfig.dht_rpc_timeout,
) -> OrphanFreeDHT:
    """Fork the DHT process of `start_dht` and return at once: it starts p2pd and joins while this process goes on
    (an island builds its model meanwhile). `await_dht` waits for it and turns its failure into a clear error."""
    identity = ensure_identity(identity)
    key = load_identity(identity)
    kwargs: dict = {"host_maddrs": host_maddrs, "identity_path": identity, "client_mode": client_mode}
    # Whether another running peer holds the identity: only a key this process did not generate may be held.
    kwargs["check_if_identity_free"] = not generated_here(identity)
    if announce_maddrs:
        kwargs["announce_maddrs"] = announce_maddrs
    if membership is not None:
        kwargs["authorizer"] = MembershipAuthorizer(key, membership)
    # A refused bootstrap ping must not end the start-up: the caller asks the peers why (a private swarm?).
    # No cache refresh: hivemind re-reads a cached key over the network whenever a read is answered from this node
    # near the key's expiry, and group keys (declared for a second) are always near it: a look-up answered from
    # this node's replica (net/replica.py) cost a full walk in the background all the same.
    dht = OrphanFreeDHT(
        cache_refresh_before_expiry=0,
        initial_peers=initial_peers or None,
        start=False,
        record_validators=record_validators(key),
        ensure_bootstrap_success=False,
        wait_timeout=rpc_timeout,
        bootstrap_timeout=max(rpc_timeout, BOOTSTRAP_TIMEOUT_S),
        **kwargs,
    )
    dht.identity_key = key
    dht.join_request = {"initial_peers": initial_peers, "host_maddrs": host_maddrs, "identity": identity}
    dht.start()
    return dht


def await_dht(dht: OrphanFreeDHT, timeout: float) -> OrphanFreeDHT:
    """Wait for a launched DHT node to be ready; stop it and raise JoinError or ListenError if it cannot be."""
    request = dht.join_request
    initial_peers, host_maddrs, identity = request["initial_peers"], request["host_maddrs"], request["identity"]
    try:
        dht.wait_until_ready(timeout)
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
        if "address already in use" in str(error) or "failed to listen" in str(error):
            raise ListenError(
                f"cannot listen on {' '.join(host_maddrs)}: the port is in use (another island?); pass another "
                "port in --host-maddrs, or port 0 for any free one"
            ) from None
        raise JoinError(f"could not start the DHT node: {reason}") from None
    return dht


def launch_island_dht(
    network: NetworkConfig, extra_peers: list[str] = (), membership: Membership | None = None
) -> OrphanFreeDHT:
    """Launch this island's DHT node from its network config (plus peers remembered from an earlier run);
    `await_dht(dht, network.join_timeout)` waits for it."""
    return launch_dht(
        initial_peers=list(network.initial_peers) + list(extra_peers),
        client_mode=network.client_mode == "on",
        host_maddrs=network.host_maddrs,
        announce_maddrs=network.announce_maddrs,
        identity=network.identity,
        membership=membership,
        rpc_timeout=network.dht_rpc_timeout,
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
