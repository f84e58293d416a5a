"""One logging setup for every command."""

from __future__ import annotations

import logging


def setup_logging(level: str) -> None:
    """Log p2p-diloco's messages at `level` with a time stamp and the module name."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
