"""--peers-file: the multiaddrs of live peers, kept so that a restart joins through them and not only the bootstrap."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from p2p_diloco.files import write_lines_atomically

logger = logging.getLogger(__name__)

MAX_PEERS = 32
"""Multiaddrs kept in a peers file."""


def write_peers_file(path: str, maddrs: Iterable[str]) -> None:
    """Keep up to MAX_PEERS distinct full multiaddrs (with /p2p/), atomically; a failure is only a warning."""
    lines = list(dict.fromkeys(m for m in maddrs if isinstance(m, str) and "/p2p/" in m))[:MAX_PEERS]
    if not lines:
        return
    try:
        write_lines_atomically(path, lines)
    except OSError as error:
        logger.warning(f"could not write --peers-file {path}: {error}")


def read_peers_file(path: str | None) -> list[str]:
    """The multiaddrs an earlier run left in the file (none if it does not exist)."""
    if not path or not Path(path).is_file():
        return []
    return [line.strip() for line in Path(path).read_text(errors="replace").splitlines() if "/p2p/" in line]
