"""A newcomer's first round: trained on the swarm's anchor while the rest of the state downloads, and waiting a
round of the swarm's for its first group.

The island is real (tiny model, real inner steps and outer optimizer); its exchange is test_island_rounds' script,
whose state download hands over the anchor first and holds the rest back until the island has trained on it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_island_rounds import FakeExchange, FakeRecords, island, merged_with, no_partner, run

from p2p_diloco.diloco.outer import OuterOptimizer, state_digest
from p2p_diloco.island.island import Island
from p2p_diloco.net.state_transfer import verified_download

State = tuple[dict[str, Any], list[torch.Tensor]]


class AnchorFirstExchange(FakeExchange):
    """Each download j hands `downloads_[j]`'s early (metadata, anchor) to the island, waits until the island has
    trained, then returns that download's final state."""

    def __init__(self, rounds: list, trained: threading.Event):
        super().__init__(rounds)
        self.trained = trained
        self.scripted: list[Callable[[], tuple[State, State | None]]] = []
        self.trained_before_the_rest: list[bool] = []

    def load_state(self, timeout: float, peers=None, *, on_anchor=None, **checks):
        self.downloads.append(peers)
        if not self.scripted:
            return None
        (metadata, tensors), final = self.scripted.pop(0)()
        if on_anchor is None:
            return final
        on_anchor(metadata, tensors[0])
        self.trained_before_the_rest.append(self.trained.wait(timeout=60))
        return final


def swarm_state_at(node: Island, step: int, shift: float) -> State:
    """A consistent state of the node's model, `shift` away from its own, at outer `step`."""
    metadata, tensors = node.state.for_peers()
    tensors = [tensor + shift for tensor in tensors]
    return {**metadata, "outer_step": step, "digest": state_digest(*tensors)}, tensors


def newcomer(tmp_path: Path, rounds: list, **overrides: Any) -> tuple[Island, AnchorFirstExchange, list[int]]:
    """A newcomer to a swarm at step 8 whose inner training is counted (steps per call) and signalled."""
    trained = threading.Event()
    exchange = AnchorFirstExchange(rounds, trained)
    settings = {"train.outer_steps": 9, "network.state_wait_s": 0.0, **overrides}
    node = island(tmp_path, exchange, FakeRecords({"peer-b": {"outer_step": 8}}), **settings)
    train, calls = node.trainer.train, []

    def counted(steps: int, **kwargs: Any):
        result = train(steps, **kwargs)
        if steps:
            calls.append(steps)
            trained.set()
        return result

    node.trainer.train = counted
    return node, exchange, calls


def test_a_newcomer_trains_on_the_anchor_while_the_rest_of_the_state_downloads(tmp_path: Path) -> None:
    node, exchange, calls = newcomer(tmp_path, [merged_with(lambda payload: payload * 0.5)])
    donor = swarm_state_at(node, 8, shift=0.25)
    exchange.scripted = [lambda: (donor, donor)]
    (record,) = run(node)
    assert exchange.trained_before_the_rest == [True]  # its inner steps ran while the momentum was on the wire
    assert calls == [node.config.train.inner_steps]  # and were kept: one round's worth
    sent, metadata, _ = exchange.sent[0]
    assert metadata["outer_step"] == 8 and metadata["digest"] == donor[0]["digest"]
    anchor, momentum = donor[1]
    outer = OuterOptimizer(anchor.clone(), lr=node.config.train.outer_lr, momentum=node.config.train.outer_momentum)
    outer.load(anchor, momentum)
    torch.testing.assert_close(node.state.anchor, outer.step(sent * 0.5), rtol=0, atol=0)
    assert record["merged"] and record["outer_step"] == 9 and record["start_outer_step"] == 8
    assert record["start_digest"] == donor[0]["digest"]
    assert 0 <= record["anchor_s"] <= record["restore_s"]
    assert node.link.records.announced[0]["outer_step"] == 8  # announced once the state was in, not before


def test_a_round_trained_on_an_anchor_the_verified_state_does_not_hold_is_trained_again(tmp_path: Path) -> None:
    # The donor trained on between its anchor and the end of the download (or failed the digest and the next donor
    # is a round further): the island drops those inner steps and trains from the state it adopted.
    node, exchange, calls = newcomer(
        tmp_path, [merged_with(lambda payload: payload * 0.5)], **{"train.outer_steps": 10}
    )
    early, final = swarm_state_at(node, 8, shift=0.25), swarm_state_at(node, 9, shift=-0.5)
    exchange.scripted = [lambda: (early, final)]
    (record,) = run(node)
    inner = node.config.train.inner_steps
    assert calls == [inner, inner]  # the round was trained twice
    assert exchange.sent[0][1]["outer_step"] == 9 and exchange.sent[0][1]["digest"] == final[0]["digest"]
    assert record["outer_step"] == 10 and record["merged"]


def test_a_download_that_fails_after_its_anchor_leaves_nothing_of_it(tmp_path: Path) -> None:
    settings = {"train.outer_steps": 1, "network.max_staleness": 100}
    node, exchange, calls = newcomer(tmp_path, [merged_with(lambda payload: payload * 0.0)], **settings)
    fresh = node.state.anchor.clone()
    early = swarm_state_at(node, 8, shift=0.25)
    exchange.scripted = [lambda: (early, None)]  # the anchor came, the rest never verified
    run(node)
    assert calls == [node.config.train.inner_steps] * 2
    assert exchange.sent[0][1]["outer_step"] == 0  # from its own (fresh) state, not the anchor it was sent
    assert not torch.allclose(node.state.anchor, early[1][0]) and torch.equal(node.state.anchor, fresh)


def _state(step: int, anchor: torch.Tensor) -> State:
    tensors = [anchor, torch.zeros(3)]
    return {"outer_step": step, "digest": state_digest(*tensors), "fingerprint": "m"}, tensors


HONEST = _state(4, torch.ones(3))


@pytest.mark.parametrize(
    "offer, honest",
    [
        (HONEST, True),
        (({**HONEST[0], "outer_step": 5}, HONEST[1]), False),  # metadata of another state than it claimed
        ((HONEST[0], [torch.full((3,), float("nan")), HONEST[1][1]]), False),
        ((HONEST[0], [torch.ones(4), HONEST[1][1]]), False),
    ],
    ids=["honest", "other-step", "nan", "shape"],
)
def test_only_an_anchor_that_can_be_the_claimed_states_is_handed_over_early(offer: State, honest: bool) -> None:
    handed: list[torch.Tensor] = []

    async def ask(peer: str) -> dict:
        return HONEST[0]

    async def download(peer: str, sink):
        sink(offer[0], offer[1][0])
        return offer

    async def fetch() -> State | None:
        return await verified_download(
            ["donor"], ask=ask, download=download, fingerprint="m", shapes=[(3,), (3,)], max_step=None,
            on_liar=lambda peer, why: None, timeout=5, on_anchor=lambda metadata, anchor: handed.append(anchor),
        )  # fmt: skip

    result = asyncio.run(fetch())
    assert len(handed) == (1 if honest else 0)
    assert (result is not None) == honest


class GraceRecordingExchange(FakeExchange):
    """Records the grace window of every averaging round."""

    def __init__(self, rounds: list):
        super().__init__(rounds)
        self.graces: list[float] = []

    def average(self, payload, metadata, *, grace_s, **kwargs):
        self.graces.append(grace_s)
        return super().average(payload, metadata, grace_s=grace_s, **kwargs)


@pytest.mark.parametrize("gap_s", [12.0, 1000.0], ids=["paced", "liar-capped"])
def test_a_newcomers_first_exchange_waits_a_round_of_the_swarms_for_a_group(tmp_path: Path, gap_s: float) -> None:
    # Trained during its download, a newcomer is ready before its partners finish their round's inner steps: with
    # only its 2 s grace window it stepped alone, off the swarm's lineage.
    history = [[step, 3.0, 1000.0 + step * gap_s] for step in range(4)]
    view = {"peer-b": {"outer_step": 0, "history": history}, "peer-c": {"outer_step": 0, "leaving": True}}
    exchange = GraceRecordingExchange([no_partner(), no_partner()])
    node = island(tmp_path, exchange, FakeRecords(view), **{"train.outer_steps": 2, "network.grace_s": 2.0})
    run(node)
    first_wait_s = min(gap_s, node.config.network.averaging_timeout)  # a liar's pace waits no longer than a round may
    assert 2.0 < first_wait_s and exchange.graces[0] == first_wait_s
    assert exchange.graces[1] < first_wait_s  # only the first: dead partners' paced records last until they expire


def test_a_newcomer_to_a_swarm_without_paced_records_keeps_its_grace_window(tmp_path: Path) -> None:
    exchange = GraceRecordingExchange([no_partner()])
    view = {"peer-b": {"outer_step": 0, "history": [[0, 3.0, 1000.0]]}}  # one round times nothing
    run(island(tmp_path, exchange, FakeRecords(view), **{"network.grace_s": 2.0}))
    assert exchange.graces == [2.0]
