"""Getting back onto the swarm's lineage: catching up when too stale, realigning after a merge off the lineage."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

import torch

from p2p_diloco.diloco.fragments import Fragment
from p2p_diloco.diloco.lineage import canonical_lineage, donors
from p2p_diloco.diloco.outer import state_digest
from p2p_diloco.island.outer_state import OuterState
from p2p_diloco.net.state_transfer import AnchorSink

logger = logging.getLogger(__name__)


class CatchUpStatus(enum.Enum):
    """How a catch-up went."""

    ADOPTED = "adopted"
    """A newer state was downloaded and adopted."""
    NO_NEWER_DONOR = "no newer donor"
    """No donor answered with a state newer than this island's."""


@dataclass(frozen=True)
class CatchUp:
    """The result of a catch-up: its status and the outer step the island is at afterwards."""

    status: CatchUpStatus
    outer_step: int


class Resync:
    """Downloads the swarm's state for an island that fell off the swarm's lineage."""

    def __init__(self, exchange: Any, state: OuterState, *, timeout: float):
        self.exchange, self.state, self.timeout = exchange, state, timeout

    def download(
        self, peers: list[str] | None = None, max_step: int | None = None, on_anchor: AnchorSink | None = None
    ) -> tuple[dict, list] | None:
        """A verified state (of our model and shapes) from the donors, or None; `on_anchor` gets its anchor early."""
        shapes = [tuple(tensor.shape) for tensor in self.state.tensors()]
        checks = dict(shapes=shapes, fingerprint=self.state.fingerprint, max_step=max_step, on_anchor=on_anchor)
        return self.exchange.load_state(timeout=self.timeout, peers=peers, **checks)

    def catch_up(self, max_step: int | None = None) -> CatchUp:
        """Drop local progress and adopt the newest state the donors agree on, if it is newer than ours."""
        found = self.download(max_step=max_step)
        if found is None or int(found[0]["outer_step"]) <= self.state.outer_step:
            return CatchUp(CatchUpStatus.NO_NEWER_DONOR, self.state.outer_step)
        self.state.adopt(*found, source="a donor")
        return CatchUp(CatchUpStatus.ADOPTED, self.state.outer_step)

    def realign(
        self, partners: dict[str, dict[str, Any]], pre_digest: str, merged: torch.Tensor, fragment: Fragment
    ) -> bool:
        """After a merge: if this island's (fragment's) state was off the group's canonical lineage, fetch it.

        Returns True when the island took a donor's state. A donor that had not applied this round yet (its
        digest is the canonical one) gets the merge applied on top; a whole-model resync otherwise takes the
        donor's clock, a fragment resync the group's, so the island syncs the same fragments as the group.
        """
        state = self.state
        members = {"": (state.outer_step - 1, pre_digest)}  # this island, before the merge it just applied
        members.update({peer: (int(data["outer_step"]), str(data["digest"])) for peer, data in partners.items()})
        canonical = canonical_lineage(members)
        if members[""] == canonical:
            return False
        found = self.download(peers=donors(members, canonical))
        if found is None:
            logger.warning("off the group's lineage and no donor answered; keeping own anchor")
            return False
        metadata, tensors = found
        if metadata.get("fingerprint") != state.fingerprint:
            return False
        donor_view = tensors if fragment.whole else [fragment.take(tensors[0]), fragment.take(tensors[1])]
        unmerged = state_digest(*donor_view) == canonical[1]  # the donor had not applied this round yet
        with state.lock:
            if fragment.whole:
                state.load(tensors, canonical[0] if unmerged else int(metadata["outer_step"]))
            else:
                state.load_fragment(fragment, tensors)
            if unmerged:
                state.step(merged, fragment)
            if unmerged or not fragment.whole:
                state.outer_step = canonical[0] + 1
        donor = donors(members, canonical)[0]
        logger.info(f"resynchronised anchor from {donor[:12]}... at outer step {state.outer_step}")
        return True
