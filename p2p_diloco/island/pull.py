"""Taking the swarm's current model without training: join the DHT as a client, download a verified state, leave.

The state is checked the way a newcomer's is (several donors asked, the digest most of them agree on, shapes of
our model, finite values; see `p2p_diloco.net.state_transfer`). The puller announces no island record, joins no
group and serves no state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from p2p_diloco.config import PeerConfig
from p2p_diloco.errors import UserError
from p2p_diloco.island.checkpoints import swarm_state
from p2p_diloco.island.link import SwarmLink, check_admission, network_exchange, private_membership
from p2p_diloco.island.outer_state import OuterState
from p2p_diloco.island.resync import Resync
from p2p_diloco.island.trainer import check_vocabulary, run_fingerprint
from p2p_diloco.net.dht import await_dht, launch_island_dht
from p2p_diloco.net.identity import ensure_identity
from p2p_diloco.net.records import RunRecords
from p2p_diloco.train.model import build_model
from p2p_diloco.train.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class PullError(UserError, RuntimeError):
    """Nothing to pull: nobody trains the run, or no donor delivered a state that checks out."""


@dataclass
class Pulled:
    """A verified state of the swarm and the model it fills."""

    model: torch.nn.Module
    state: OuterState
    islands: int
    """Islands of the run the DHT knew when the state was pulled."""


def _no_state() -> tuple[dict[str, Any], list[torch.Tensor]]:
    raise RuntimeError("a puller serves no state")


def _check_model(islands: dict[str, dict[str, Any]], fingerprint: str, run_id: str) -> None:
    """No island announcing our model means the wrong --config: say so at once rather than wait for donors."""
    theirs = sorted({str(info.get("fingerprint")) for info in islands.values()})
    if fingerprint not in theirs:
        raise PullError(
            f"run {run_id!r} trains model {', '.join(theirs)}, the config given builds {fingerprint}: pass the "
            "run's peer config (--config, or --swarm NAME) and any model or tokenizer flags its islands use"
        )


def pull(config: PeerConfig) -> Pulled:
    """Download the swarm's current, verified outer state for the model of `config` (PullError if none)."""
    network = config.network
    model = build_model(config.model, config.train.seed)
    tokenizer = load_tokenizer(config.data.tokenizer, config.data.eos_token)
    check_vocabulary(model, tokenizer, config)
    fingerprint = run_fingerprint(model, config, tokenizer)
    flat = torch.cat([parameter.detach().reshape(-1) for parameter in model.parameters()])
    state = OuterState(
        flat,
        lr=config.train.outer_lr,
        momentum=config.train.outer_momentum,
        momentum_every=config.train.momentum_every,
        fingerprint=fingerprint,
        run_id=network.run_id,
    )
    network.identity = ensure_identity(network.identity)
    membership = private_membership(network)
    dht = await_dht(launch_island_dht(network, membership=membership), network.join_timeout)
    link = SwarmLink(peer_id=dht.peer_id.to_base58(), dht=dht, network=network, membership=membership)
    try:
        check_admission(dht, network, membership, link.peer_id)
        link.records = RunRecords(
            dht, network.run_id, link.peer_id, ttl=network.announce_ttl, timeout=network.dht_timeout
        )
        islands = link.records.read()
        if not islands:
            raise PullError(
                f"nobody trains run {network.run_id!r}: the DHT reached through {' '.join(network.initial_peers)} "
                "holds no island of it; check --run-id and --initial-peers (`p2p-diloco swarms --initial-peers ...`)"
            )
        _check_model(islands, fingerprint, network.run_id)
        # An averager that only downloads: client mode serves no state and leads no group; it never averages,
        # so a one-value buffer is enough.
        link.exchange = network_exchange(dht, network, membership, size=1, state_provider=_no_state, client_mode=True)
        found = swarm_state(link, network, Resync(link.exchange, state, timeout=network.state_timeout))
        if found is None:
            raise PullError(
                f"run {network.run_id!r} has {len(islands)} islands but none delivered a state of this model that "
                f"checks out within {network.state_wait_s:.0f}s; is --config the run's model (fingerprint "
                f"{fingerprint})? raise --state-wait-s to wait longer"
            )
        state.adopt(*found, source="the swarm")
    finally:
        link.close()
    return Pulled(model=model, state=state, islands=len(islands))
