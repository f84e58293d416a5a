"""The island metadata read out of a peer's gathered bytes: the dict it sent, or an empty one for anything else."""

from __future__ import annotations

import pytest
from hivemind.utils import MSGPackSerializer

from p2p_diloco.net.gathered import island_metadata


def envelope(inner: bytes) -> bytes:
    """What hivemind's averager gathers: [bandwidth, mode, the island's own metadata as MessagePack]."""
    return MSGPackSerializer.dumps([100.0, 0, inner])


def test_an_islands_metadata_comes_back_as_sent() -> None:
    sent = {"membership": "token", "search_deadline": 12.5, "tokens": 4096}
    assert island_metadata(envelope(MSGPackSerializer.dumps(sent))) == sent


@pytest.mark.parametrize(
    "gathered",
    [
        b"",
        b"\xc1 not messagepack",
        MSGPackSerializer.dumps([100.0, 0]),  # no third field
        MSGPackSerializer.dumps({"not": "a list"}),
        envelope(b"\xc1"),  # the inner level is not MessagePack
        envelope(MSGPackSerializer.dumps([1, 2, 3])),  # the inner level is not a dict
        envelope(MSGPackSerializer.dumps(None)),
    ],
)
def test_bytes_of_any_other_shape_read_as_no_metadata(gathered: bytes) -> None:
    assert island_metadata(gathered) == {}
