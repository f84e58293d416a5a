"""GossipExchange.average(out=...): a buffer the merge cannot be written into is refused before the round."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from p2p_diloco.net.dht import shutdown_dht, start_dht
from p2p_diloco.net.exchange import GossipExchange

SIZE = 1000


@pytest.fixture(scope="module")
def exchange() -> Iterator[GossipExchange]:
    dht = start_dht(
        initial_peers=[], host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[], identity=None, timeout=30
    )
    try:
        exchange = GossipExchange(
            dht,
            run_id="out-test",
            size=SIZE,
            state_provider=lambda **_: ({}, []),
            target_group_size=2,
            quorum=1,
            min_matchmaking_time=0.2,
            request_timeout=1.0,
            allreduce_timeout=5.0,
            next_chunk_timeout=2.0,
        )
        try:
            yield exchange
        finally:
            exchange.shutdown()
    finally:
        shutdown_dht(dht)


@pytest.mark.parametrize(
    "out, why",
    [
        (torch.zeros(SIZE, dtype=torch.float64), "float32"),
        (torch.zeros(SIZE // 2), f"at least {SIZE}"),
        (torch.zeros(SIZE, 2)[:, 0], "not contiguous"),
    ],
)
def test_an_out_buffer_the_merge_cannot_land_in_is_refused_before_the_round(
    exchange: GossipExchange, out: torch.Tensor, why: str
) -> None:
    with pytest.raises(ValueError, match=why):
        exchange.average(torch.ones(SIZE), {}, weight=1.0, grace_s=0.1, timeout=0.5, out=out)


def test_a_round_without_partners_leaves_the_out_buffer_as_it_was(exchange: GossipExchange) -> None:
    out = torch.full((SIZE,), 7.0)
    result = exchange.average(torch.ones(SIZE), {}, weight=1.0, grace_s=0.2, timeout=1.0, out=out)
    assert result.merged is None and result.error
    assert torch.equal(out, torch.full((SIZE,), 7.0))
