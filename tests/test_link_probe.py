"""SwarmLink's probe of recent partners that missed a round: who counts as silent, and when not."""

from __future__ import annotations

import time
from concurrent.futures import Future

from p2p_diloco.island.link import PROBE_MARGIN_S, PROBE_S, SwarmLink


def _answered(peers: set[str]) -> Future:
    future: Future = Future()
    future.set_result(peers)
    return future


def test_a_peer_that_did_not_answer_is_silent_until_it_is_back_in_a_group() -> None:
    link = SwarmLink(peer_id="me")
    link.missing = {"frozen", "slow"}
    link.probing = (["frozen", "slow"], _answered({"slow"}), time.monotonic())
    assert link.silent() == {"frozen"}
    link.probe(["frozen"])  # the next round: still missing (no DHT here, so no new probe starts)
    assert link.silent() == {"frozen"}
    link.probe([])  # it merged with us again
    assert link.silent() == set()


def test_a_probe_that_ends_after_its_peer_came_back_is_stale() -> None:
    link = SwarmLink(peer_id="me")
    link.probing = (["woken"], Future(), time.monotonic())
    link.probe([])  # the woken island was in the last group before the probe reported
    link.probing[1].set_result(set())
    assert link.silent() == set()


def test_a_probe_the_dht_never_reports_rules_nobody_out() -> None:
    link = SwarmLink(peer_id="me")
    link.missing = {"peer"}
    link.probing = (["peer"], Future(), time.monotonic() - PROBE_S - PROBE_MARGIN_S - 0.1)
    assert link.silent() == set()
    assert link.probing is None
