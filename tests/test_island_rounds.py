"""The island's round logic without processes: a fake exchange and fake run records drive every branch.

Each test runs a real `Island` (tiny model, real inner steps, real outer optimizer) whose link to the swarm is a
script: what each averaging round returns and what a state download serves. The multi-process tests in
test_swarm.py and test_decoupled_swarm.py check the same behaviour with real daemons.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY

from p2p_diloco.config import load_config
from p2p_diloco.diloco.outer import OuterOptimizer
from p2p_diloco.island import outer_state
from p2p_diloco.island.island import Island
from p2p_diloco.island.link import SwarmLink
from p2p_diloco.net.exchange import ExchangeResult
from p2p_diloco.train.metrics import read_metrics

ME = "me"


class FakeRecords:
    """The run's records: the other islands' announcements, as the test sets them."""

    def __init__(self, view: dict[str, dict[str, Any]] | None = None):
        self.view = view or {}
        self.announced: list[dict[str, Any]] = []

    def announce(self, info: dict[str, Any], *, check: bool) -> dict[str, dict[str, Any]]:
        self.announced.append(dict(info))
        return dict(self.view)


class FakeExchange:
    """Answers averaging round i with `rounds[i](payload, metadata)` and state download j with `states[j]()`.

    The first download is the one every island makes when it joins; downloads past the list find no donor.
    """

    def __init__(self, rounds: list[Callable[[torch.Tensor, dict], ExchangeResult]]):
        self.rounds = list(rounds)
        self.states: list[Callable[[], Any]] = []
        self.sent: list[tuple[torch.Tensor, dict, float]] = []
        self.downloads: list[list[str] | None] = []
        self.check_max_step = False
        self.group_targets: list[int | None] = []
        self.size = 1 << 20

    def average(
        self, payload, metadata, *, weight, grace_s, timeout, schema_tag=None, group_target=None, out=None
    ) -> ExchangeResult:
        self.sent.append((payload.clone(), dict(metadata), weight))
        self.group_targets.append(group_target)
        result = self.rounds.pop(0)(payload, metadata)
        if out is not None and result.merged is not None:  # as GossipExchange: the merge lands in the caller's buffer
            merged = result.merged.reshape(-1)
            result.merged = out[: merged.numel()].copy_(merged)
        return result

    def load_state(self, timeout: float, peers=None, **checks):
        self.downloads.append(peers)
        state = self.states.pop(0)() if self.states else None
        max_step = checks.get("max_step") if self.check_max_step else None
        if state is not None and max_step is not None and int(state[0]["outer_step"]) > max_step:
            return None  # as verified_download: a donor past what the swarm can have reached is a liar
        return state

    def set_state_priority(self, priority: float) -> None:
        pass

    def shutdown(self) -> None:
        pass


def island(tmp_path: Path, exchange: FakeExchange, records: FakeRecords, **overrides: Any) -> Island:
    settings = {"train.outer_steps": 1, "train.inner_steps": 3, "metrics": str(tmp_path / "m.jsonl")}
    settings.update(overrides)
    config = load_config(TINY, settings)

    def connector(network, *, announcement, state_provider, exchange_size, staleness_rule) -> SwarmLink:
        return SwarmLink(peer_id=ME, exchange=exchange, records=records)

    return Island(config, connector=connector)


def partner(metadata: dict, **changes: Any) -> dict[str, dict]:
    """A partner's gathered metadata: by default on our lineage, same model and codec, same weight."""
    return {"peer-b": {**metadata, "ready": metadata["ready"], **changes}}


def merged_with(update: Callable[[torch.Tensor], torch.Tensor], **changes: Any):
    def round_(payload: torch.Tensor, metadata: dict) -> ExchangeResult:
        return ExchangeResult(merged=update(payload), partners=partner(metadata, **changes), wait_s=0.01)

    return round_


def no_partner(error: str = "no partner within the window"):
    return lambda payload, metadata: ExchangeResult(merged=None, error=error)


def expected_anchor(start: torch.Tensor, update: torch.Tensor, config) -> torch.Tensor:
    outer = OuterOptimizer(start, lr=config.train.outer_lr, momentum=config.train.outer_momentum)
    return outer.step(update).clone()


def run(node: Island) -> list[dict]:
    node.run()
    return read_metrics(node.config.metrics)


def test_a_merged_round_applies_the_group_update(tmp_path: Path) -> None:
    exchange = FakeExchange([merged_with(lambda payload: payload * 0.5)])
    node = island(tmp_path, exchange, FakeRecords({"peer-b": {"outer_step": 0}}))
    start = node.state.anchor.clone()
    (record,) = run(node)
    sent, metadata, weight = exchange.sent[0]
    assert metadata["outer_step"] == 0 and metadata["fingerprint"] == node.fingerprint and weight > 0
    torch.testing.assert_close(node.state.anchor, expected_anchor(start, sent * 0.5, node.config), rtol=0, atol=0)
    assert record["merged"] and record["partners"] == 1 and record["group"] == ["peer-b"]
    assert not record["resynced"] and record["note"] is None and len(record["merge_weights"]) == 2


def test_the_group_target_follows_the_islands_that_keep_coming(tmp_path: Path) -> None:
    def merged_with_peers(*peers: str):
        def round_(payload: torch.Tensor, metadata: dict) -> ExchangeResult:
            partners = {peer: {**metadata, "ready": metadata["ready"]} for peer in peers}
            return ExchangeResult(merged=payload * 0.5, partners=partners, wait_s=0.01)

        return round_

    rounds = [merged_with_peers("peer-b", "peer-c"), merged_with_peers("peer-b"), merged_with_peers("peer-b")]
    exchange = FakeExchange(rounds)
    view = {peer: {"outer_step": 0, "time": 0.0} for peer in ("peer-b", "peer-c")}  # announced long ago
    overrides = {"train.outer_steps": 3, "network.expect_rounds": 1, "network.target_group_size": 8}
    run(island(tmp_path, exchange, FakeRecords(view), **overrides))
    # No history yet: the configured cap. Then everyone of the last round; peer-c, gone since, is no longer waited for.
    assert exchange.group_targets == [8, 3, 2]


@pytest.mark.parametrize("error", ["no partner within the window", "AllreduceException: partial all-reduce"])
def test_a_round_without_a_merge_applies_the_own_update(tmp_path: Path, error: str) -> None:
    exchange = FakeExchange([no_partner(error)])
    node = island(tmp_path, exchange, FakeRecords())
    start = node.state.anchor.clone()
    (record,) = run(node)
    sent = exchange.sent[0][0]
    torch.testing.assert_close(node.state.anchor, expected_anchor(start, sent, node.config), rtol=0, atol=0)
    assert not record["merged"] and record["partners"] == 0 and record["note"] == error


def test_a_round_with_a_foreign_island_is_discarded(tmp_path: Path) -> None:
    exchange = FakeExchange([merged_with(lambda payload: payload * 0.0, fingerprint="someone-else")])
    node = island(tmp_path, exchange, FakeRecords())
    start = node.state.anchor.clone()
    (record,) = run(node)
    torch.testing.assert_close(node.state.anchor, expected_anchor(start, exchange.sent[0][0], node.config))
    assert not record["merged"] and "model or codec mismatch" in record["note"] and "peer-b" in record["note"]


def test_a_merge_that_weighed_a_partner_too_far_behind_is_discarded(tmp_path: Path) -> None:
    # A pair: the group's clock is the lower claim, so a partner woken at step 2 with a view too young to doubt
    # weighs in full. This island knows it is at step 8 itself: it keeps its anchor off that merge.
    exchange = FakeExchange([merged_with(lambda payload: payload * 0.0, outer_step=2, swarm_step=2)])
    node = island(tmp_path, exchange, FakeRecords({"peer-b": {"outer_step": 8}}), **{"train.outer_steps": 9})
    exchange.states = [lambda: donor_state(node, 8)]  # joins the swarm at step 8
    (record,) = run(node)
    assert node.outer_step == 9 and exchange.sent[0][1]["outer_step"] == 8
    assert not record["merged"] and record["partners"] == 0 and "peer-b by 6" in record["note"]


def test_a_non_finite_merge_is_never_applied(tmp_path: Path) -> None:
    exchange = FakeExchange([merged_with(lambda payload: torch.full_like(payload, float("nan")))])
    node = island(tmp_path, exchange, FakeRecords())
    (record,) = run(node)
    assert bool(torch.isfinite(node.state.anchor).all())
    assert not record["merged"] and "NaN or inf" in record["note"]


def test_a_donor_postpones_its_solo_steps_while_a_peer_downloads_its_state(tmp_path: Path, monkeypatch) -> None:
    # A newcomer's download of a large state spans several of the donor's rounds (benchmarks/restart_link.py): a step
    # taken alone meanwhile leaves it stale on arrival, and it downloads the whole state again.
    monkeypatch.setattr(outer_state, "SETTLE_MIN_BYTES", 0)  # the tiny model's state counts as large
    rounds = [no_partner(), no_partner(), merged_with(lambda payload: payload * 0.5), no_partner(), no_partner()]
    exchange = FakeExchange(rounds)
    node = island(tmp_path, exchange, FakeRecords({"peer-b": {"outer_step": 0}}), **{"train.outer_steps": 3})
    start_digest = node.state.digest()
    node.state.for_peers()  # a newcomer asks for the state
    records = run(node)
    assert [r["outer_step"] for r in records] == [0, 0, 1, 2, 3]
    assert all("postponed" in r["note"] and r["anchor_digest"] == start_digest for r in records[:2])
    # The merged round carries the postponed rounds' work, and its weight; after the merge, steps alone go on.
    sent = [metadata for _, metadata, _ in exchange.sent]
    assert [metadata["steps"] for metadata in sent] == [3, 6, 9, 3, 3]
    assert sent[2]["tokens"] == 3 * sent[3]["tokens"] and sent[2]["outer_step"] == 0
    assert records[2]["merged"] and all(r["note"] == "no partner within the window" for r in records[3:])


def test_a_round_expected_alone_lets_a_newcomer_download_at_once(tmp_path: Path) -> None:
    # Waiting for a round that can only land alone (its step postponed once the state is served) cost a restart over
    # 100 Mbit/s 1.5 s of its 8.8 s state transfer (benchmarks/restart_link.py).
    settled_during_round: list[bool] = []

    def watched(round_):
        def call(payload: torch.Tensor, metadata: dict) -> ExchangeResult:
            settled_during_round.append(node.state._settled.is_set())
            return round_(payload, metadata)

        return call

    rounds = [watched(merged_with(lambda payload: payload * 0.5)), watched(no_partner()), watched(no_partner())]
    view = {"peer-b": {"outer_step": 0, "time": 0.0}}  # announced long ago
    overrides = {"train.outer_steps": 3, "network.expect_rounds": 1}
    node = island(tmp_path, FakeExchange(rounds), FakeRecords(view), **overrides)
    run(node)
    # No history yet, then peer-b from the last merge: the state waits; once peer-b stopped coming, it does not.
    assert settled_during_round == [False, False, True]


def test_the_last_outer_step_is_never_postponed(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(outer_state, "SETTLE_MIN_BYTES", 0)
    node = island(tmp_path, FakeExchange([no_partner()]), FakeRecords())
    node.state.for_peers()
    (record,) = run(node)
    assert record["outer_step"] == 1 and record["note"] == "no partner within the window"


def donor_state(node: Island, step: int, shift: float = 1.0):
    metadata, tensors = node.state.for_peers()
    tensors = [tensor + shift for tensor in tensors]
    return {**metadata, "outer_step": step}, tensors


def test_a_too_stale_island_catches_up_instead_of_exchanging(tmp_path: Path) -> None:
    exchange = FakeExchange([no_partner()])  # the round after the catch-up
    node = island(tmp_path, exchange, FakeRecords({"peer-b": {"outer_step": 9}}), **{"train.outer_steps": 12})
    exchange.states = [lambda: None, lambda: donor_state(node, 11)]  # nobody at join; a donor at step 11 later
    first, second = run(node)
    assert len(exchange.sent) == 1  # only the round after the catch-up sent anything
    assert first["resynced"] and first["outer_step"] == 11 and first["partners"] == 0
    assert first["note"] == "9 steps stale: contribution rejected, resynced to outer step 11"
    assert second["outer_step"] == 12 and not second["resynced"]


def test_an_island_that_joined_an_empty_looking_swarm_catches_up_once_it_sees_the_swarm(tmp_path: Path) -> None:
    # The DHT showed nobody at join (its bootstrap had just restarted): the island trained from step 0. Its first
    # view of the swarm, at step 51, is believed: its own steps alone are no view to bound a claim by.
    records = FakeRecords()

    def alone_then_the_swarm_shows_up(payload, metadata):
        records.view = {"peer-b": {"outer_step": 51}, "peer-c": {"outer_step": 51}}
        return ExchangeResult(merged=None, error="no partner within the window")

    exchange = FakeExchange([alone_then_the_swarm_shows_up])
    node = island(tmp_path, exchange, records, **{"train.outer_steps": 2})
    exchange.states, exchange.check_max_step = [lambda: None, lambda: donor_state(node, 51)], True
    first, second = run(node)
    assert first["outer_step"] == 1 and not first["resynced"]
    assert second["resynced"] and second["outer_step"] == 51, second["note"]


def test_a_too_stale_island_with_no_newer_donor_applies_its_own_update(tmp_path: Path) -> None:
    exchange = FakeExchange([])
    node = island(tmp_path, exchange, FakeRecords({"peer-b": {"outer_step": 9}}))
    start = node.state.anchor.clone()
    (record,) = run(node)
    assert exchange.sent == [] and not record["resynced"] and node.outer_step == 1
    assert record["note"] == "9 steps stale and no newer donor answered"
    assert not torch.equal(node.state.anchor, start)


def test_an_island_woken_after_the_swarm_left_trains_on_from_its_own_step(tmp_path: Path) -> None:
    # The others finished at step 9 and announced they were leaving. One catch-up looks for a donor still lingering;
    # with none, the departed islands' step no longer sets the clock: the island syncs its fragments in turn from
    # its own step, instead of failing a catch-up every round and stepping the swarm clock's fragment forever.
    exchange = FakeExchange([no_partner(), no_partner()])
    view = {"peer-b": {"outer_step": 9, "leaving": True}, "peer-c": {"outer_step": 9, "leaving": True}}
    overrides = {"train.outer_steps": 3, "train.inner_steps": 4, "train.fragments": 2}
    node = island(tmp_path, exchange, FakeRecords(view), **overrides)
    records = run(node)
    assert len(exchange.downloads) == 2  # at join, and the one catch-up
    assert records[0]["note"] == "9 steps stale and no newer donor answered" and records[0]["fragment"] == 1
    assert [r["staleness"][0] for r in records[1:]] == [0, 0]
    assert [metadata["fragment"] for _, metadata, _ in exchange.sent] == [1, 0]
    assert node.outer_step == 3


def test_the_group_rejects_a_stale_island_that_then_catches_up(tmp_path: Path) -> None:
    # Our view said we were current, but we were frozen for two minutes in matchmaking (our `ready` is that old)
    # and a partner knows the swarm is 6 steps ahead: that is plausible, so we give ourselves weight 0.
    def frozen_then_merged(payload, metadata):
        metadata["ready"] -= 120
        return merged_with(lambda values: values, swarm_step=6, outer_step=6)(payload, metadata)

    exchange = FakeExchange([frozen_then_merged])
    node = island(tmp_path, exchange, FakeRecords())
    exchange.states = [lambda: None, lambda: donor_state(node, 7)]
    (record,) = run(node)
    assert record["resynced"] and node.outer_step == 7 and record["merge_weights"] == [0.0]
    assert record["note"] == "6 steps stale: contribution rejected, resynced to outer step 7"
    assert torch.equal(node.state.anchor, node.trainer.weights())  # the model holds the adopted anchor


def _woken_into_a_swarm_ahead(tmp_path: Path, records: FakeRecords, swarm_step: int, announce_every: int, reread=None):
    """One round in which the group finds the island stale (frozen two minutes: the group and the island's clock
    find the lead plausible) and a donor at `swarm_step` answers; `reread` is what the records show once re-read."""

    def swarm_moved_on(payload, metadata):
        if reread is not None:
            records.view = reread
        metadata["ready"] -= 120
        node.clock.time -= 120
        return merged_with(lambda values: values, swarm_step=swarm_step, outer_step=swarm_step)(payload, metadata)

    exchange = FakeExchange([swarm_moved_on])
    node = island(tmp_path, exchange, records, **{"network.announce_every": announce_every})
    exchange.states, exchange.check_max_step = [lambda: None, lambda: donor_state(node, swarm_step)], True
    (record,) = run(node)
    return node, record


def test_a_group_that_finds_the_island_stale_between_announces_sends_it_where_the_swarm_is_now(
    tmp_path: Path,
) -> None:
    # The island announced at step 0 and, announcing every 10 rounds, has not read the records since; meanwhile
    # the swarm reached step 7. The group tells it it is stale: its catch-up must accept a donor at step 7.
    records = FakeRecords({"peer-b": {"outer_step": 0}})
    node, record = _woken_into_a_swarm_ahead(tmp_path, records, 7, 10, reread={"peer-b": {"outer_step": 7}})
    assert record["resynced"] and node.outer_step == 7, record["note"]
    assert record["note"] == "7 steps stale: contribution rejected, resynced to outer step 7"


def test_a_stale_island_accepts_a_donor_as_far_past_its_records_as_islands_announce(tmp_path: Path) -> None:
    # peer-b's record says step 5, but islands re-announce only every 4 rounds: the donor may be at 5 + 4 + 1.
    node, record = _woken_into_a_swarm_ahead(tmp_path, FakeRecords({"peer-b": {"outer_step": 5}}), 10, 4)
    assert record["resynced"] and node.outer_step == 10, record["note"]


def test_an_island_off_the_group_lineage_downloads_the_canonical_state(tmp_path: Path) -> None:
    # A partner one step ahead is on the canonical lineage: after the merge we fetch its state.
    exchange = FakeExchange([merged_with(lambda payload: payload * 0.5, outer_step=1, digest="other-lineage")])
    node = island(tmp_path, exchange, FakeRecords({"peer-b": {"outer_step": 1}}))
    donor = {}
    exchange.states = [lambda: None, lambda: donor.setdefault("state", donor_state(node, 1, shift=0.25))]
    (record,) = run(node)
    assert exchange.downloads == [None, ["peer-b"]]  # at join, then from the canonical member only
    assert record["resynced"] and record["merged"] and node.outer_step == 1
    assert torch.equal(node.state.anchor, donor["state"][1][0])


def test_an_overlapped_streaming_island_lands_each_fragment_in_the_next_round(tmp_path: Path) -> None:
    exchange = FakeExchange([merged_with(lambda payload: payload * 0.5)] * 3)
    overrides = {"train.outer_steps": 3, "train.inner_steps": 4, "train.fragments": 2, "train.overlap_steps": 1}
    node = island(tmp_path, exchange, FakeRecords({"peer-b": {"outer_step": 0}}), **overrides)
    records = run(node)
    assert [metadata["fragment"] for _, metadata, _ in exchange.sent] == [0, 1, 0]
    assert records[0]["note"] == "first exchange in flight" and records[0]["fragment"] is None
    assert [r["fragment"] for r in records[1:]] == [0, 1, 0]  # what landed in each later round (and at the end)
    assert all(r["merged"] for r in records[1:]) and node.outer_step == 3
    sizes = {f.number: f.size for f in node.fragments}
    assert [sent.numel() for sent, _, _ in exchange.sent] == [sizes[0], sizes[1], sizes[0]]


@pytest.mark.parametrize(("every", "announces"), [(1, 1 + 6 + 1), (3, 1 + 2 + 1), (10, 1 + 0 + 1)])
def test_an_island_announces_when_it_joins_every_k_rounds_and_when_it_leaves(
    tmp_path: Path, every: int, announces: int
) -> None:
    exchange = FakeExchange([merged_with(lambda payload: payload * 0.5) for _ in range(6)])
    records = FakeRecords({"peer-b": {"outer_step": 0}})
    node = island(tmp_path, exchange, records, **{"train.outer_steps": 6, "network.announce_every": every})
    assert len(run(node)) == 6
    assert len(records.announced) == announces
    assert [entry["outer_step"] for entry in records.announced][-1] == 6  # the final state, for status
