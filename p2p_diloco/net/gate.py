"""Who an island averages with and serves: members of a private swarm, never a peer banned for misbehaving.

Peer ids are authenticated by libp2p's secure channel, so a membership token shown once (in a join request's
gathered metadata, or with `present_membership`) admits that peer id until the token expires. A peer that sends
NaN or inf is banned for `ban_rounds` rounds: its contributions are dropped and it is refused as a group member
and as a state donor meanwhile. The gate lives in the averager process and logs each refusal and ban once.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from p2p_diloco.net.membership import Membership

logger = logging.getLogger(__name__)


class Gate:
    """Admission (private swarms) and bans (every swarm) for one island."""

    def __init__(self, membership: Membership | None, ban_rounds: int):
        self.membership, self.ban_rounds = membership, ban_rounds
        self.admitted: dict[str, float] = {}
        """Peer id -> when its token expires."""
        self.banned_until: dict[str, int] = {}
        """Peer id -> the round its ban ends."""
        self.round = 0
        self._refused: set[tuple[str, str]] = set()

    @property
    def private(self) -> bool:
        """True when only members may average with, download from or serve this island."""
        return self.membership is not None

    def admit(self, peer: str, token: Any) -> str | None:
        """Check a token shown by `peer`; None if it admits the peer, else why not (logged once per reason)."""
        if not self.private:
            return None
        reason = self.membership.reason_to_refuse(token, peer)
        if reason is None:
            self.admitted[peer] = self.membership.expires(token)
            return None
        self._refuse(peer, f"it presented {reason}")
        return reason

    def member(self, peer: str) -> bool:
        """True for a peer whose token this island has checked and which has not expired or been revoked."""
        if not self.private:
            return True
        return self.admitted.get(peer, 0.0) > time.time() and peer not in self.membership.revoked

    def allowed(self, peer: str) -> bool:
        """May `peer` join this island's groups, send it parts or download its state now?"""
        if self.banned(peer):
            self._refuse(peer, "it is banned")
            return False
        if not self.member(peer):
            self._refuse(peer, "it has shown no valid membership token")
            return False
        return True

    def banned(self, peer: str) -> bool:
        """True while a ban on `peer` lasts."""
        return self.banned_until.get(peer, -1) > self.round

    def ban(self, peer: str, why: str) -> None:
        """Exclude `peer` for `ban_rounds` rounds, and say so."""
        if self.ban_rounds <= 0 or self.banned(peer):
            return
        self.banned_until[peer] = self.round + self.ban_rounds
        logger.warning(
            f"island {peer} sent {why}: its contribution is dropped and it is banned for {self.ban_rounds} rounds"
        )

    def revoke(self, document: Any) -> None:
        """Apply an owner-signed revocation list (ignored if it is not one)."""
        if self.private:
            self.membership = self.membership.with_revocations(document)

    def next_round(self) -> None:
        """A round of this island went by (bans count down)."""
        self.round += 1

    def warn_once(self, peer: str, what: str, kind: str | None = None) -> None:
        """Name a peer that misbehaved, once per kind of misbehaviour (`kind`, or the message itself)."""
        if (peer, kind or what) not in self._refused:
            self._refused.add((peer, kind or what))
            logger.warning(f"island {peer} {what}")

    def _refuse(self, peer: str, why: str) -> None:
        if (peer, why) not in self._refused:
            self._refused.add((peer, why))
            logger.warning(f"refused peer {peer}: {why}")
