"""An island's own metadata inside the bytes a peer gathers with its join request, read as untrusted input."""

from __future__ import annotations

from typing import Any

from hivemind.utils.serializer import MSGPackSerializer


def island_metadata(gathered: bytes) -> dict[str, Any]:
    """The metadata an island passed to `step(gather=...)`, from hivemind's envelope [bandwidth, mode, metadata]
    (each level MessagePack); an empty dict for bytes of any other shape, which are the sender's problem."""
    try:
        metadata = MSGPackSerializer.loads(MSGPackSerializer.loads(gathered)[2])
    except Exception:  # a stock hivemind peer, or bytes of any shape
        return {}
    return metadata if isinstance(metadata, dict) else {}
