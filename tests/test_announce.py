"""When an island announces itself, and how partners' steps keep its view of the swarm current in between."""

from __future__ import annotations

from p2p_diloco.island.announce import AnnounceSchedule, fold_partner_steps


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_scheduled_announce_comes_every_k_rounds_and_an_unscheduled_one_restarts_the_count() -> None:
    clock = FakeClock()
    schedule = AnnounceSchedule(every=3, max_interval_s=1000, clock=clock)
    assert not schedule.fresh
    assert schedule.start(scheduled=False)  # joining always announces
    assert schedule.fresh
    assert [schedule.start(scheduled=True) for _ in range(6)] == [False, False, True, False, False, True]
    schedule.start(scheduled=True)
    assert schedule.start(scheduled=False)
    assert [schedule.start(scheduled=True) for _ in range(3)] == [False, False, True]


def test_a_round_without_partners_hurries_the_next_announce() -> None:
    schedule = AnnounceSchedule(every=4, max_interval_s=1000, clock=FakeClock())
    schedule.start(scheduled=False)
    assert not schedule.start(scheduled=True)
    schedule.hurry()
    assert schedule.start(scheduled=True)
    assert not schedule.start(scheduled=True)  # and the count starts again


def test_a_long_round_announces_before_the_record_can_expire() -> None:
    clock = FakeClock()
    schedule = AnnounceSchedule(every=10, max_interval_s=20, clock=clock)
    assert schedule.start(scheduled=False)
    clock.now = 19.9
    assert not schedule.start(scheduled=True)
    clock.now = 20.0
    assert schedule.start(scheduled=True)
    clock.now = 25.0
    assert not schedule.start(scheduled=True)


def test_every_round_announces_with_k_of_one() -> None:
    schedule = AnnounceSchedule(every=1, max_interval_s=1000, clock=FakeClock())
    assert all(schedule.start(scheduled=True) for _ in range(5))


def test_partners_steps_update_only_known_islands_and_only_forward() -> None:
    view = {"a": {"outer_step": 3, "maddrs": ["x"]}, "b": {"outer_step": 5}, "c": {"outer_step": 2}}
    partners = {
        "a": {"outer_step": 4},  # newer: taken, the rest of its record kept
        "b": {"outer_step": 4},  # older than its record: ignored
        "c": {"outer_step": True},  # not an integer step: ignored
        "d": {"outer_step": 9},  # never announced: not added
        "e": "garbage",
    }
    assert fold_partner_steps(view, partners) == 1
    assert view == {"a": {"outer_step": 4, "maddrs": ["x"]}, "b": {"outer_step": 5}, "c": {"outer_step": 2}}


def test_a_dashboard_polling_between_announces_sees_every_round_of_the_short_history() -> None:
    from p2p_diloco.cli.dashboard import History
    from p2p_diloco.island.progress import MIN_HISTORY, Progress, history_rounds

    for every in (1, 4, 7):
        kept = history_rounds(every)
        assert kept >= max(MIN_HISTORY, 2 * every) or kept == 32  # never more than the schema accepts
        progress, seen = Progress("run", kept), History()
        for step in range(1, 41):
            progress.add({"outer_step": step, "tokens": 100 * step, "round_s": 1.0, "time": float(step)})
            if step % every == 0 or step == 40:  # announces (and on leaving); the dashboard reads each
                seen.update({"islands": [{"peer_id": "island", "history": progress.history()}]})
        rounds = [entry[0] for entry in seen.snapshot()["islands"][0]["history"]]
        assert rounds == list(range(1, 41)), f"announcing every {every} rounds"
        assert len(progress.history()) == kept < 40


def test_the_state_donor_priority_changes_at_most_twice_per_declare_period(monkeypatch) -> None:
    # hivemind re-declares a donor in the DHT on every change of priority: once per round was a third of the stores
    from p2p_diloco.net import exchange as exchange_module

    class Averager:
        client_mode, declare_state_period = False, 10.0

        def __init__(self) -> None:
            self.declared: list[float] = []

        @property
        def state_sharing_priority(self) -> float:
            return self.declared[-1]

        @state_sharing_priority.setter
        def state_sharing_priority(self, value: float) -> None:
            self.declared.append(value)

    clock = FakeClock()
    monkeypatch.setattr(exchange_module.time, "monotonic", clock)
    exchange = object.__new__(exchange_module.GossipExchange)
    exchange.averager = Averager()
    exchange._priority_set_at = float("-inf")
    for step in range(1, 31):  # a round every second
        clock.now = float(step)
        exchange.set_state_priority(float(step))
    assert exchange.averager.declared == [1.0, 6.0, 11.0, 16.0, 21.0, 26.0]
