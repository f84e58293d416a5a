"""Private swarms: an owner's Ed25519 key, membership tokens it signs offline, and the revocation list.

A token says "peer P may join (run R) until T", signed by the owner; the owner's public key is all an island
needs to check one. Tokens are bound to a peer id, and libp2p's secure channel authenticates the peer id of
every connection, so a token is useless to anyone but its peer: it can be shown in the clear. No server is
involved at run time.

    owner key file     PEM (PKCS#8), kept private
    public key text    "ed25519:<base64 of the 32 raw bytes>"
    token file         JSON {"token": {"v", "peer_id", "run_id", "issued", "expires"}, "signature": base64}
    revocation list    JSON {"revoked": {"v", "peer_ids", "issued"}, "signature": base64}
"""

from __future__ import annotations

import base64
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from p2p_diloco.errors import UserError
from p2p_diloco.files import atomic_write

PREFIX = "ed25519:"
VERSION = 1


class MembershipError(UserError):
    """A key, token or revocation list that cannot be used; the message says what to do."""


def _canonical(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()


def new_owner_key(path: str | os.PathLike) -> str:
    """Create an owner key file (mode 0600, never overwritten); returns its public key text."""
    path = Path(path)
    if path.exists():
        raise MembershipError(f"{path} exists already; choose another --out (an owner key is never overwritten)")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    atomic_write(path, pem)
    os.chmod(path, 0o600)
    return public_text(key.public_key())


def load_owner_key(path: str | os.PathLike) -> Ed25519PrivateKey:
    """The owner's private key from its file."""
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as error:
        raise MembershipError(
            f"owner key {path} cannot be read ({error}); create one with `p2p-diloco keys new`"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise MembershipError(f"owner key {path} is not an Ed25519 key; create one with `p2p-diloco keys new`")
    return key


def public_text(key: Ed25519PublicKey) -> str:
    """'ed25519:<base64>' of a public key, what islands pass as --swarm-public-key."""
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return PREFIX + base64.b64encode(raw).decode()


def parse_public_key(text: str) -> Ed25519PublicKey:
    """A --swarm-public-key value, or a one-line error."""
    try:
        if not text.startswith(PREFIX):
            raise ValueError("it does not start with 'ed25519:'")
        return Ed25519PublicKey.from_public_bytes(base64.b64decode(text[len(PREFIX) :], validate=True))
    except ValueError as error:
        raise MembershipError(
            f"--swarm-public-key {text!r} is not an owner public key ({error}); copy the line `keys new` printed"
        ) from None


def _sign(key: Ed25519PrivateKey, name: str, payload: dict[str, Any]) -> dict[str, Any]:
    return {name: payload, "signature": base64.b64encode(key.sign(_canonical(payload))).decode()}


def _verify(owner: Ed25519PublicKey, name: str, document: Any) -> dict[str, Any] | None:
    """The signed payload if `document` holds a valid owner signature over it, else None."""
    if not isinstance(document, dict) or not isinstance(document.get(name), dict):
        return None
    try:
        owner.verify(base64.b64decode(str(document.get("signature")), validate=True), _canonical(document[name]))
    except (InvalidSignature, ValueError):
        return None
    return document[name]


def issue_token(key: Ed25519PrivateKey, peer_id: str, expires_in_s: float, run_id: str | None = None) -> dict:
    """A membership token for `peer_id`, valid for `expires_in_s` seconds (for any run of the owner if no run)."""
    now = int(time.time())
    payload = {"v": VERSION, "peer_id": peer_id, "run_id": run_id, "issued": now, "expires": now + int(expires_in_s)}
    return _sign(key, "token", payload)


def revocation_list(key: Ed25519PrivateKey, peer_ids: list[str], previous: dict | None = None) -> dict:
    """A signed list of revoked peer ids (adding to `previous`, if given)."""
    earlier = list(((previous or {}).get("revoked") or {}).get("peer_ids") or [])
    payload = {"v": VERSION, "peer_ids": sorted(set(earlier + peer_ids)), "issued": int(time.time())}
    return _sign(key, "revoked", payload)


def read_json(path: str | os.PathLike, what: str) -> dict:
    """A token or revocation file, or a one-line error."""
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise MembershipError(f"{what} {path} cannot be read ({error})") from None
    if not isinstance(document, dict):
        raise MembershipError(f"{what} {path} is not a JSON object")
    return document


def parse_duration(text: str) -> float:
    """'30d', '12h', '90m', '45s' or seconds, as seconds."""
    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    try:
        value = float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text)
    except ValueError:
        value = -1
    if not value > 0:
        raise MembershipError(f"--expires {text!r} must be a positive duration like 30d, 12h, 90m or 3600")
    return value


@dataclass
class Membership:
    """What a private-swarm island checks others against: the owner's key, revocations, its own token."""

    owner: Ed25519PublicKey
    token: dict | None = None
    """This island's own token document (shown to others), if it has one."""
    revoked: frozenset[str] = frozenset()
    run_id: str | None = None

    def reason_to_refuse(self, document: Any, peer_id: str, now: float | None = None) -> str | None:
        """Why `document` does not admit `peer_id` (None: it does)."""
        payload = _verify(self.owner, "token", document)
        if payload is None:
            return "no membership token signed by the swarm's owner"
        now = time.time() if now is None else now
        if payload.get("peer_id") != peer_id:
            return f"a token issued to {payload.get('peer_id')}, not to {peer_id}"
        if not isinstance(payload.get("expires"), int) or payload["expires"] <= now:
            return "a membership token that has expired"
        if payload.get("run_id") not in (None, self.run_id):
            return f"a token for run {payload.get('run_id')!r}"
        if peer_id in self.revoked:
            return "a revoked membership"
        return None

    def expires(self, document: Any) -> float:
        """When a (valid) token expires."""
        payload = _verify(self.owner, "token", document) or {}
        return float(payload.get("expires", 0))

    def issued(self, document: Any) -> int:
        """When a (valid) revocation list was issued (-1 if it is not one)."""
        payload = _verify(self.owner, "revoked", document)
        return int(payload.get("issued", 0)) if payload is not None else -1

    def with_revocations(self, document: Any) -> Membership:
        """This membership with the peer ids of a valid owner-signed revocation list added."""
        payload = _verify(self.owner, "revoked", document)
        if payload is None:
            return self
        peer_ids = [peer for peer in payload.get("peer_ids") or [] if isinstance(peer, str)]
        return Membership(self.owner, self.token, self.revoked | frozenset(peer_ids), self.run_id)


def load_membership(
    public_key: str, token_path: str | None, revoked_path: str | None, peer_id: str, run_id: str
) -> Membership:
    """The island's membership, checked at start: a missing, foreign or expired token is a one-line error."""
    membership = Membership(parse_public_key(public_key), run_id=run_id)
    if revoked_path:
        document = read_json(revoked_path, "revocation list")
        if _verify(membership.owner, "revoked", document) is None:
            raise MembershipError(f"revocation list {revoked_path} is not signed by the swarm's owner")
        membership = membership.with_revocations(document)
    if token_path is None:
        raise MembershipError(
            f"this swarm is private: pass --membership TOKEN (ask its owner for a token for peer id {peer_id}; "
            "pass the same --identity the token was issued for)"
        )
    token = read_json(token_path, "membership token")
    if (reason := membership.reason_to_refuse(token, peer_id)) is not None:
        raise MembershipError(
            f"membership token {token_path} does not admit this island ({reason}); peer id {peer_id} needs a token "
            "from the swarm's owner for its --identity"
        )
    membership.token = token
    return membership
