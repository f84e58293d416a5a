"""Where an island starts (the swarm's state, its own checkpoint or a fresh init) and what its checkpoints hold."""

from __future__ import annotations

from p2p_diloco.config import PeerConfig
from p2p_diloco.island.link import SwarmLink
from p2p_diloco.island.outer_state import OuterState
from p2p_diloco.island.trainer import LocalTrainer
from p2p_diloco.net.records import ModelMismatchError
from p2p_diloco.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint


def restore(config: PeerConfig, state: OuterState, trainer: LocalTrainer, link: SwarmLink) -> str:
    """Start from the freshest of: the swarm's current state, this island's checkpoint, a fresh init.

    Returns where the island started, for the log. The model ends up holding the anchor.
    """
    checkpoint = None
    if config.checkpoint_dir and (path := latest_checkpoint(config.checkpoint_dir)) is not None:
        checkpoint = load_checkpoint(path)
        if checkpoint.get("fingerprint") != state.fingerprint:
            raise ModelMismatchError(
                f"model mismatch: checkpoint {path} holds model {checkpoint.get('fingerprint')}, "
                f"the config builds {state.fingerprint}; point --checkpoint-dir elsewhere"
            )
    swarm = link.exchange.load_state(timeout=config.network.state_timeout) if link.online else None
    swarm_step = int(swarm[0]["outer_step"]) if swarm else -1
    if checkpoint is not None:
        state.load(checkpoint["outer_tensors"], int(checkpoint["outer_step"]))
        trainer.load_state_dict(checkpoint)
    if swarm is not None and swarm_step >= state.outer_step and swarm_step > 0:
        state.adopt(*swarm, source="the swarm")
        origin = f"swarm state at outer step {swarm_step}"
    elif checkpoint is not None:
        origin = f"checkpoint at outer step {state.outer_step}"
    else:
        origin = "fresh initialisation"
    trainer.load_all(state.anchor)
    return origin


def save(config: PeerConfig, state: OuterState, trainer: LocalTrainer) -> None:
    """Write a checkpoint of the outer state and local training, every `checkpoint_every` outer steps."""
    if not config.checkpoint_dir or state.outer_step % config.checkpoint_every:
        return
    with state.lock:
        snapshot = {**state.checkpoint(), **trainer.state_dict()}
    save_checkpoint(config.checkpoint_dir, snapshot, snapshot["outer_step"])
