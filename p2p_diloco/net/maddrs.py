"""Validation of user-supplied multiaddrs with the `multiaddr` package, before anything starts."""

from __future__ import annotations

from collections.abc import Iterable

from multiaddr import Multiaddr

from p2p_diloco.errors import UserError


class MultiaddrError(UserError, ValueError):
    """A multiaddr the user must fix; the message names it."""


def validate_maddr(text: str, *, need_peer_id: bool) -> str:
    """Return the multiaddr unchanged if it parses (and ends with /p2p/<id> when required), else raise."""
    try:
        maddr = Multiaddr(text)
    except Exception as error:  # the package raises several parse errors; all mean "fix this address"
        reason = str(error).split(" (string:")[0]
        raise MultiaddrError(f"bad multiaddr {text!r}: {reason}") from None
    protocols = [protocol.name for protocol in maddr.protocols()]
    if need_peer_id and "p2p" not in protocols:
        raise MultiaddrError(
            f"bad multiaddr {text!r}: it needs the peer id, like /ip4/1.2.3.4/tcp/31337/p2p/Qm... "
            "(copy the full line a bootstrap prints)"
        )
    if not {"tcp", "udp"} & set(protocols):
        raise MultiaddrError(f"bad multiaddr {text!r}: it needs a /tcp/<port> or /udp/<port>/quic part")
    return text


def validate_maddrs(texts: Iterable[str], *, need_peer_id: bool) -> list[str]:
    """Validate every multiaddr, raising on the first bad one."""
    return [validate_maddr(text, need_peer_id=need_peer_id) for text in texts]
