"""hivemind logs normal events of a gossip swarm as errors with tracebacks; p2p-diloco reports them itself.

A round that finds no partner, or whose group falls apart, is part of normal operation here: the exchange returns
it as `ExchangeResult.error` and the island logs one INFO line of its own per round. hivemind's averager also logs
it, from its child process, as an ERROR with a full traceback (`logger.exception`) or a WARNING before a retry.
These filters turn those records into one DEBUG line; they must be installed before the averager process forks.
A failed group that hivemind retries within the same round ("caught ..., retrying") becomes one INFO line instead:
the island's own line reports only the round's last error, and the first one is the one that says why a group
fell apart (in CI, an island left a fresh group at once, retried and found nobody, with no trace of why).
"""

from __future__ import annotations

import asyncio
import logging

_ROUND_FAILURES = (
    "could not find a group",
    "Unable to run All-Reduce",
    "partial all-reduce",
    "gave up on the rest of the round",
)


class _DemoteRoundFailures(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING and record.getMessage().endswith(", retrying"):
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info = record.exc_text = None
            return logging.getLogger(record.name).isEnabledFor(logging.INFO)
        if record.levelno >= logging.WARNING and any(text in record.getMessage() for text in _ROUND_FAILURES):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.exc_info = record.exc_text = None
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


class _DropDroppedHandlerConnections(logging.Filter):
    """asyncio's report of a p2pd handler connection that closed before sending a byte (harmless)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (
            record.getMessage().startswith("Unhandled exception in client_connected_cb")
            and isinstance(error, asyncio.IncompleteReadError)
        )


_INSTALLED = False


def quiet_hivemind() -> None:
    """Install the filters (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    for name in ("hivemind.averaging.averager", "hivemind.averaging.matchmaking"):
        logging.getLogger(name).addFilter(_DemoteRoundFailures())
    logging.getLogger("asyncio").addFilter(_DropDroppedHandlerConnections())
    _INSTALLED = True
