"""A standby's warm-up runs at idle CPU priority and every thread leaves it afterwards."""

from __future__ import annotations

import os
import threading

import pytest

from p2p_diloco.island.idle_priority import can_leave_idle_priority, idle_priority

pytestmark = pytest.mark.skipif(not can_leave_idle_priority(), reason="needs Linux and root or RLIMIT_NICE")


def test_threads_started_at_idle_priority_leave_it_with_the_process() -> None:
    release = threading.Event()
    started = threading.Event()
    policies: dict[str, int] = {}

    def worker() -> None:
        policies["worker at start"] = os.sched_getscheduler(0)
        started.set()
        release.wait(30)

    with idle_priority("test warm-up") as lowered:
        assert lowered
        policies["main inside"] = os.sched_getscheduler(0)
        thread = threading.Thread(target=worker)  # as torch's pool threads, started during the warm-up
        thread.start()
        assert started.wait(30)
    try:
        assert policies == {"main inside": os.SCHED_IDLE, "worker at start": os.SCHED_IDLE}
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
        assert os.sched_getscheduler(thread.native_id) == os.SCHED_OTHER
    finally:
        release.set()
        thread.join()


def test_an_error_in_the_warm_up_still_restores_the_priority() -> None:
    with pytest.raises(RuntimeError), idle_priority("test warm-up"):
        raise RuntimeError("the model would not build")
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
