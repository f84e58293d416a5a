"""One round's pseudo-gradient of one fragment, on its way to the group and back.

Each encoding for the wire sits beside its decoding: error feedback compensates the pseudo-gradient going out
and learns the codec's residual when the merge comes back; RDA encodes directions and norms going out and
decodes the merge coming back. `judge` decides what the island applies: the group's merge, its own update
(no partner, a failed or foreign round), or nothing (the group found it too stale).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from hivemind.utils import get_dht_time

from p2p_diloco.config import NetworkConfig
from p2p_diloco.diloco.error_feedback import ErrorFeedback
from p2p_diloco.diloco.fragments import Fragment
from p2p_diloco.diloco.merge import contribution_weight, is_finite, rda_decode, rda_encode
from p2p_diloco.diloco.quantize import quantizer
from p2p_diloco.diloco.sparse import topk_sparsify
from p2p_diloco.diloco.staleness import StalenessRule, group_weights, own_clock, own_weight, stale_partners
from p2p_diloco.island.rounds import Verdict
from p2p_diloco.net.codecs import describe_strangers, strangers
from p2p_diloco.net.exchange import ExchangeResult

logger = logging.getLogger(__name__)


def round_metadata(*, network: NetworkConfig, tokens: int, steps: int, **fields: Any) -> dict[str, Any]:
    """The metadata a contribution travels with: who, where, how much work, and its weight under the merge rule."""
    base_weight = contribution_weight(network.merge, tokens, steps)
    return {**fields, "codec": network.codec, "tokens": tokens, "steps": steps, "base_weight": base_weight}


class Contribution:
    """A pseudo-gradient prepared for the wire, with the metadata partners weigh and check it by."""

    def __init__(
        self,
        delta: torch.Tensor,
        fragment: Fragment,
        metadata: dict[str, Any],
        *,
        peer_id: str,
        merge_rule: str,
        codec: str,
        staleness_rule: StalenessRule,
        feedback: ErrorFeedback | None,
        topk_density: float = 0.02,
    ):
        self.delta, self.fragment, self.metadata = delta, fragment, metadata
        self.peer_id, self.merge_rule, self.codec = peer_id, merge_rule, codec
        self.staleness_rule, self.feedback = staleness_rule, feedback
        self._residual = None if feedback is None else feedback.residual  # for `postpone`: judge may clear it
        self.compensated = delta if feedback is None else feedback.compensate(delta)
        """The pseudo-gradient plus the residual the codec dropped last round."""
        self.sent = topk_sparsify(self.compensated, topk_density) if codec == "topk" else self.compensated
        """What goes into the all-reduce (topk: the largest values of each chunk; the rest waits in the residual)."""

    @property
    def pre_digest(self) -> str:
        """Digest of the fragment's outer state before this round's merge (the island's lineage)."""
        return self.metadata["digest"]

    @property
    def offered_weight(self) -> float:
        """The weight this island offers by its own view of the swarm: the group rule over a group of one."""
        return group_weights({self.peer_id: self.metadata}, self.staleness_rule)[self.peer_id]

    def payload(self) -> torch.Tensor:
        """The vector that goes into the all-reduce."""
        if self.merge_rule == "rda":
            return rda_encode(self.compensated, self.fragment.tensor_sizes)
        return self.sent

    def _accept(self, merged: torch.Tensor) -> torch.Tensor:
        """The group's average of payloads, decoded into a pseudo-gradient; error feedback learns the residual."""
        if self.feedback is not None:
            self.feedback.update(quantizer(self.codec).round_trip(self.sent), self.compensated)
        return rda_decode(merged, self.fragment.tensor_sizes) if self.merge_rule == "rda" else merged

    def _own(self, result: ExchangeResult, note: str | None) -> Verdict:
        """Apply this island's own full-precision update: nothing was lost, so error feedback starts over."""
        if self.feedback is not None:
            self.feedback.clear()
        return Verdict(result, self.compensated, merged=False, note=note, weights={self.peer_id: self.offered_weight})

    def postpone(self) -> None:
        """The island keeps this round's progress in its weights instead of applying it: the residual the codec
        dropped in earlier rounds goes back to error feedback (an own update's verdict cleared it)."""
        if self.feedback is not None:
            self.feedback.residual = self._residual

    def judge(self, result: ExchangeResult) -> Verdict:
        """What the island applies after `result`: the group's merge, its own update, or nothing when stale."""
        if result.merged is None:
            return self._own(result, result.error)
        members = {self.peer_id: self.metadata, **result.partners}
        try:
            weights = group_weights(members, self.staleness_rule)
            mine = own_weight(self.peer_id, members, self.staleness_rule, get_dht_time())
            laggards = stale_partners(self.peer_id, members, weights, self.staleness_rule)
        except (KeyError, TypeError, ValueError):  # an island of another kind: the agreement check below discards it
            weights, mine, laggards = {}, None, {}
        if mine == 0.0:
            # Our view of the swarm was older than the group's (e.g. we were stalled): we sent weight 0, so catch
            # up instead of applying its merge.
            stale_by = own_clock(self.peer_id, members, get_dht_time()) - int(self.metadata["outer_step"])
            return Verdict(result, None, merged=False, stale_by=stale_by, weights={self.peer_id: 0.0})
        if laggards:
            lags = ", ".join(f"{peer} by {lag}" for peer, lag in sorted(laggards.items()))
            note = f"round discarded: the group weighed partners too far behind this island's outer step ({lags})"
            logger.warning(note)
            return self._own(result, note)
        found = strangers(self.metadata, result.partners)
        if found:
            note = f"model or codec mismatch: discarded a round with islands of another kind: {sorted(found)}"
            logger.warning(f"{note} ({describe_strangers(self.metadata, found)})")
            return self._own(result, note)
        if not is_finite(result.merged):
            note = "NaN or inf in the merged update from a peer: round discarded"
            logger.warning(note)
            return self._own(result, note)
        return Verdict(
            result,
            self._accept(result.merged),
            merged=True,
            weights={peer: weights.get(peer) for peer in members},
            partners=result.partners,
        )
