"""A donor holds a state request while a round of its own is in flight, so a newcomer gets the state that round
lands, not the one it replaces (which would be a step old on arrival and cost the newcomer a second download)."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import torch

from p2p_diloco.diloco.fragments import Fragment
from p2p_diloco.diloco.outer import state_digest
from p2p_diloco.island import outer_state
from p2p_diloco.island.outer_state import OuterState

WHOLE = Fragment(number=0, count=1, index=slice(None), tensor_sizes=(8,), size=8)


def _state() -> OuterState:
    return OuterState(torch.zeros(8), lr=0.7, momentum=0.9, momentum_every=1, fingerprint="f", run_id="r")


def _serve_in_background(state: OuterState) -> tuple[threading.Thread, list]:
    served: list = []
    thread = threading.Thread(target=lambda: served.append(state.for_peers()), daemon=True)
    thread.start()
    return thread, served


@pytest.fixture(autouse=True)
def _every_state_is_large(monkeypatch) -> None:
    monkeypatch.setattr(outer_state, "SETTLE_MIN_BYTES", 0)


def test_a_small_state_is_served_at_once_even_with_a_round_in_flight(monkeypatch) -> None:
    monkeypatch.setattr(outer_state, "SETTLE_MIN_BYTES", 8 * 8 + 1)
    state = _state()
    state.round_in_flight()
    assert state.for_peers()[0]["outer_step"] == 0


def test_a_settled_state_is_served_at_once() -> None:
    state = _state()
    metadata, tensors = state.for_peers()
    assert metadata["outer_step"] == 0 and len(tensors) == 2


def test_a_round_in_flight_is_waited_for_and_its_step_served() -> None:
    state = _state()
    state.round_in_flight()
    thread, served = _serve_in_background(state)
    thread.join(timeout=0.3)
    assert thread.is_alive(), "the state was served while the round was in flight"
    state.step(torch.ones(8), WHOLE)
    state.round_landed()
    thread.join(timeout=5)
    assert not thread.is_alive()
    metadata, tensors = served[0]
    assert metadata["outer_step"] == 1
    assert torch.equal(tensors[0], state.anchor)


def test_a_round_that_never_lands_holds_a_request_only_for_the_bound(monkeypatch) -> None:
    monkeypatch.setattr(outer_state, "SETTLE_WAIT_S", 0.2)
    state = _state()
    state.round_in_flight()
    thread, served = _serve_in_background(state)
    thread.join(timeout=5)
    assert not thread.is_alive(), "a round stuck in flight held the state request past its bound"
    assert served[0][0]["outer_step"] == 0


def test_serving_a_large_state_holds_solo_steps_until_a_merge_or_the_askers_deadline() -> None:
    state = _state()
    assert not state.holding(round_s=1.0)  # nobody asked
    state.for_peers()
    assert state.holding(round_s=1.0)
    state.release()  # a merged round landed
    assert not state.holding(round_s=1.0)
    state.for_peers()
    state.hold_s = 0.0
    assert state.holding(round_s=30.0) and not state.holding(round_s=0.0)  # the deadline plus one round


def test_serving_a_small_state_holds_nothing(monkeypatch) -> None:
    monkeypatch.setattr(outer_state, "SETTLE_MIN_BYTES", 8 * 8 + 1)
    state = _state()
    state.for_peers()
    assert not state.holding(round_s=1.0)


def test_a_download_after_the_probe_is_served_at_once_during_the_hold() -> None:
    state = _state()
    state.for_peers()  # the newcomer's probe starts the hold: solo steps are postponed from here
    state.round_in_flight()
    thread, served = _serve_in_background(state)
    thread.join(timeout=5)
    assert not thread.is_alive(), "the download waited for a round that can only be postponed or merge"
    assert served[0][0]["outer_step"] == 0


def test_requests_renew_a_hold_but_never_past_two_deadlines(monkeypatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(outer_state.time, "monotonic", lambda: clock[0])
    state = _state()
    state.hold_s = 10.0
    state.for_peers()
    for _ in range(3):  # a peer asks again every 6 s
        clock[0] += 6.0
        assert state.holding(round_s=1.0)
        state.for_peers()
    clock[0] += 6.0  # 24 s since the hold began: past 2 x 10 s and a round, though the last request was 6 s ago
    assert not state.holding(round_s=1.0)


def test_a_round_expected_alone_is_not_waited_for_and_starts_the_hold() -> None:
    state = _state()
    state.round_in_flight(may_merge=False)  # nobody else is expected: its step is postponed once the state is served
    thread, served = _serve_in_background(state)
    thread.join(timeout=5)
    assert not thread.is_alive(), "the probe waited for a round expected to land alone"
    assert served[0][0]["outer_step"] == 0
    assert state.holding(round_s=1.0), "the round's solo step would leave the newcomer's state stale"


def test_a_probe_gets_the_digest_without_the_tensors_and_the_digest_follows_every_change() -> None:
    state = _state()
    metadata, tensors = state.for_peers(with_tensors=False)
    full, copies = state.for_peers()
    assert tensors == [] and metadata == full and len(copies) == 2
    assert metadata["digest"] == state_digest(*copies)
    state.step(torch.ones(8), WHOLE)
    stepped, copies = state.for_peers()
    assert stepped["digest"] != metadata["digest"] and stepped["digest"] == state_digest(*copies)
    state.load([torch.full((8,), 3.0), torch.zeros(8)], outer_step=5)
    loaded, copies = state.for_peers(with_tensors=False)
    assert loaded["outer_step"] == 5 and loaded["digest"] == state_digest(torch.full((8,), 3.0), torch.zeros(8))
    half = Fragment(number=0, count=2, index=slice(0, 4), tensor_sizes=(8,), size=4)
    state.load_fragment(half, [torch.ones(8), torch.ones(8)])
    assert state.digest() == state_digest(*state.tensors()) != loaded["digest"]


class _Pings:
    """A stand-in for the island's ping of a round's partners: each call's future, answered by the test."""

    def __init__(self) -> None:
        self.futures: list[Future] = []
        self.started = threading.Event()

    def __call__(self) -> Future:
        self.futures.append(Future())
        self.started.set()
        return self.futures[-1]


def test_a_round_whose_partners_answer_no_ping_is_not_waited_for() -> None:
    state, pings = _state(), _Pings()
    state.round_in_flight(pinger=pings)  # its partner was killed just before the round began
    thread, served = _serve_in_background(state)
    assert pings.started.wait(5), "the request did not ping the round's partners"
    pings.futures[0].set_result(set())
    thread.join(timeout=5)
    assert not thread.is_alive(), "the request waited for a round whose partners are gone"
    assert served[0][0]["outer_step"] == 0
    assert state.holding(round_s=1.0)


def test_a_round_whose_partner_answers_is_still_waited_for() -> None:
    state, pings = _state(), _Pings()
    state.round_in_flight(pinger=pings)
    thread, served = _serve_in_background(state)
    assert pings.started.wait(5)
    pings.futures[0].set_result({"partner"})
    thread.join(timeout=0.3)
    assert thread.is_alive(), "the state was served while a round with a live partner was in flight"
    state.step(torch.ones(8), WHOLE)
    state.round_landed()
    thread.join(timeout=5)
    assert served[0][0]["outer_step"] == 1


def test_a_late_ping_answer_does_not_release_the_next_round() -> None:
    state, pings = _state(), _Pings()
    state.round_in_flight(pinger=pings)
    thread, _ = _serve_in_background(state)
    assert pings.started.wait(5)
    state.round_landed()
    thread.join(timeout=5)
    state.release()
    state._served_at = None  # the newcomer merged: the next request starts a hold again
    state.round_in_flight(pinger=None)  # the next round, with live partners
    pings.futures[0].set_result(set())  # the first round's ping ends only now
    thread, served = _serve_in_background(state)
    thread.join(timeout=0.3)
    assert thread.is_alive(), "an old round's ping released the state while the next round was in flight"
    state.round_landed()
    thread.join(timeout=5)
    assert served
