"""A round's group-key declaration must expire after the island's previous one, or the DHT refuses it."""

from __future__ import annotations

from p2p_diloco.net.declarations import DECLARATION_GAP_S, DeclarationClock


def test_a_round_after_a_longer_window_is_scheduled_past_its_declaration() -> None:
    clock = DeclarationClock()
    first = clock.schedule(now=100.0, grace_s=3.0)
    assert first == 103.0
    clock.ended(first, now=100.2, min_matchmaking_time=0.5, deadline=110.0)  # the group filled at once
    # The next round wants a 1.5 s window (another fragment's): 101.7 would be refused behind the standing 103.
    second = clock.schedule(now=100.3, grace_s=1.5)
    assert second == 103.0 + DECLARATION_GAP_S
    # Once the old declaration has expired the window is the round's own again.
    clock.ended(second, now=100.5, min_matchmaking_time=0.5, deadline=110.0)
    assert clock.schedule(now=104.0, grace_s=1.5) == 105.5


def test_a_round_that_searched_past_its_schedule_counts_its_redeclarations() -> None:
    clock = DeclarationClock()
    scheduled = clock.schedule(now=0.0, grace_s=1.0)
    clock.ended(scheduled, now=4.0, min_matchmaking_time=0.5, deadline=4.2)  # re-declared until the deadline
    assert clock.declared_until == 4.2
    assert clock.schedule(now=4.1, grace_s=1.0) == 5.1
    assert clock.schedule(now=3.0, grace_s=1.0) == 4.2 + DECLARATION_GAP_S
