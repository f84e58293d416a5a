"""The all-or-nothing all-reduce: unit tests of the reducer, and real averaging groups of member processes."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from exchange_member import member_vector
from hivemind.compression import deserialize_torch_tensor
from hivemind.proto.runtime_pb2 import CompressionType
from members import Members

from p2p_diloco.net.reducers import RobustPartReducer, StrictPartReducer
from p2p_diloco.net.repair import REPAIR_WINDOW_S, ServedParts, valid_first_part
from p2p_diloco.process import kill_process_tree

NONE = CompressionType.NONE


def test_reducer_averages_parts() -> None:
    async def scenario() -> list[torch.Tensor]:
        reducer = StrictPartReducer([torch.Size([3])] * 2, [math.inf] * 2, None)
        results = []
        for part in range(2):
            first = asyncio.create_task(reducer.accumulate_part(0, part, torch.full((3,), 1.0), weight=1.0))
            second = asyncio.create_task(reducer.accumulate_part(1, part, torch.full((3,), 4.0), weight=3.0))
            results.append((await first).clone())
            await second
        return results

    for result in asyncio.run(scenario()):
        torch.testing.assert_close(result, torch.full((3,), (1.0 + 12.0) / 4.0))


def test_reducer_poisons_parts_after_a_sender_fails_midway() -> None:
    async def scenario() -> tuple[torch.Tensor, torch.Tensor]:
        reducer = StrictPartReducer([torch.Size([2])] * 2, [math.inf] * 2, None)
        first = asyncio.create_task(reducer.accumulate_part(0, 0, torch.ones(2)))
        await reducer.accumulate_part(1, 0, torch.ones(2) * 3)
        part0 = (await first).clone()
        pending = asyncio.create_task(reducer.accumulate_part(0, 1, torch.ones(2)))
        await asyncio.sleep(0)
        reducer.on_sender_failed(1)  # sender 1 dies after sending one of its two parts
        return part0, (await pending).clone()

    part0, part1 = asyncio.run(scenario())
    torch.testing.assert_close(part0, torch.full((2,), 2.0))
    assert torch.isnan(part1).all(), "a part reduced without a failed sender must not look valid"


def test_reducer_keeps_results_when_a_sender_fails_after_sending_everything() -> None:
    async def scenario() -> torch.Tensor:
        reducer = StrictPartReducer([torch.Size([2])], [math.inf] * 2, None)
        first = asyncio.create_task(reducer.accumulate_part(0, 0, torch.ones(2)))
        await reducer.accumulate_part(1, 0, torch.ones(2) * 3)
        reducer.on_sender_failed(1)
        return (await first).clone()

    torch.testing.assert_close(asyncio.run(scenario()), torch.full((2,), 2.0))


def test_reducers_cap_declared_weights_and_a_robust_one_drops_a_nan_sender() -> None:
    flagged = []

    async def scenario(make) -> torch.Tensor:
        reducer = make()
        parts = [torch.full((4,), 1.0), torch.full((4,), 3.0), torch.full((4,), 5.0)]
        parts[2][0] = float("nan")
        tasks = [
            asyncio.create_task(reducer.accumulate_part(i, 0, part, weight=w))
            for i, (part, w) in enumerate(zip(parts, [1.0, 1e9, 1.0]))
        ]
        return (await asyncio.gather(*tasks))[0].clone()

    strict = asyncio.run(scenario(lambda: StrictPartReducer([torch.Size([4])], [math.inf, 1.0, math.inf], None)))
    assert torch.isnan(strict).any()  # the plain mean: one NaN value, and every member discards the round
    shapes, caps = [torch.Size([4])], [math.inf, 1.0, math.inf]
    robust = lambda: RobustPartReducer("none", shapes, caps, lambda i, why: flagged.append(i))  # noqa: E731
    torch.testing.assert_close(asyncio.run(scenario(robust)), torch.full((4,), 2.0))  # (1 + 3) / 2: capped, dropped
    assert sorted(flagged) == [1, 2]


def test_served_parts_serialize_once_and_resend_what_a_member_missed() -> None:
    calls = []

    async def scenario() -> tuple[list, list]:
        served = ServedParts(b"group", [], num_parts=3)
        resent = asyncio.create_task(_collect(served.resend(1, NONE, timeout=5.0)))
        parts = [torch.full((4,), float(index)) for index in range(3)]
        first = [await served.serialized(index, part, NONE) for index, part in enumerate(parts)]
        again = [await served.serialized(index, torch.zeros(4), NONE) for index in range(3)]  # cached: same bits
        calls.extend(id(a) == id(b) for a, b in zip(first, again))
        return [deserialize_torch_tensor(tensor) for tensor in await resent], parts

    resent, parts = asyncio.run(scenario())
    assert calls == [True, True, True], "each part is serialized once for every sender"
    assert [tensor.tolist() for tensor in resent] == [parts[1].tolist(), parts[2].tolist()]


def test_a_resend_of_a_part_the_round_never_produces_times_out() -> None:
    async def scenario() -> None:
        served = ServedParts(b"group", [], num_parts=2)
        await _collect(served.resend(0, NONE, timeout=0.2))

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(scenario())


def test_a_reducer_shutting_down_stays_for_a_resend_under_way_and_its_window() -> None:
    async def scenario() -> tuple[list[str], float]:
        served = ServedParts(b"group", [], num_parts=2)
        await served.serialized(0, torch.ones(4), NONE)
        served.end_round()
        events: list[str] = []
        resend = served.resend(0, NONE, timeout=5.0)
        await resend.__anext__()  # a member is being sent its lost parts; part 1 is not produced yet

        async def finish_resend() -> None:
            await served.serialized(1, torch.ones(4), NONE)
            await resend.__anext__()
            events.append("resent")
            await resend.aclose()

        finisher = asyncio.get_running_loop().call_later(0.1, lambda: asyncio.ensure_future(finish_resend()))
        await served.linger(budget=5.0)
        events.append("lingered")
        finisher.cancel()
        return events, time.monotonic() - served.ended_at

    events, since_end = asyncio.run(scenario())
    assert events == ["resent", "lingered"], "shutdown waited for the resend under way"
    assert since_end >= REPAIR_WINDOW_S, "and for the window in which a member may still ask"


def test_a_reducer_shutting_down_never_lingers_past_its_budget() -> None:
    async def scenario() -> float:
        served = ServedParts(b"group", [], num_parts=2)
        served.end_round()
        stuck = served.resend(0, NONE, timeout=60.0)  # waits for a part the round never produces
        waiting = asyncio.ensure_future(stuck.__anext__())
        await asyncio.sleep(0)
        started = time.monotonic()
        await served.linger(budget=0.3)
        waiting.cancel()
        return time.monotonic() - started

    assert asyncio.run(scenario()) < REPAIR_WINDOW_S


@pytest.mark.parametrize("value", [-1.0, 3.0, 0.5, float("nan"), float("inf")])
def test_a_repair_request_for_a_part_outside_the_round_is_refused(value: float) -> None:
    assert valid_first_part(value, num_parts=3) is None
    assert valid_first_part(2.0, num_parts=3) == 2


async def _collect(parts) -> list:
    return [part async for part in parts]


def _true_mean(seeds: list[int], size: int) -> torch.Tensor:
    return torch.stack([member_vector(seed, size) for seed in seeds]).mean(dim=0)


@pytest.mark.parametrize("uplink_mbit", ["0", "400"])
def test_group_gets_the_exact_mean_with_identical_bits(members: Members, uplink_mbit: str) -> None:
    # Paced lanes (an uplink declared) hold each member's replies until its own parts are out: same bits.
    size, seeds = 300_000, [1, 2, 3]
    options = ["--chunk-timeout", "10", "--uplink-mbit", uplink_mbit]
    first = members.start(seeds[0], size, 3, [], *options)
    for seed in seeds[1:]:
        members.start(seed, size, 3, [first.maddr], *options)
    members.go()
    results = [members.result(process) for process in members.processes]
    mean = _true_mean(seeds, size)
    merged = [result["merged"] for result in results if result["merged"] is not None]
    # Stock hivemind sometimes hands one member 0 parts from a reducer and still reports success (a silent
    # partial average); here that member discards the round instead, so at least two must merge.
    assert len(merged) >= 2, results
    for result in merged:
        assert result["group"] == 3
        assert result["sum"] == pytest.approx(float(mean.double().sum()), abs=1e-2)
        torch.testing.assert_close(torch.tensor(result["first"]), mean[:4], atol=1e-6, rtol=0)
    assert len({json.dumps(result) for result in merged}) == 1, "members ended with different bits"
    assert all(result["restored"] for result in results if result["merged"] is None)
    assert all(result["lanes"] == 2 for result in results if result["merged"] is not None), results


@pytest.mark.parametrize("lanes", ["on", "off", "paced"])
def test_a_member_whose_reply_stream_breaks_fetches_the_rest_and_the_round_stays_whole(
    members: Members, tmp_path: Path, lanes: str
) -> None:
    # Member 3, as a reducer, stops replying to one sender after 1 of its 3 or 4 parts but reduces them all: the bytes
    # were lost in transit (on a direct lane or a libp2p stream). That sender asks again over libp2p for parts 1..
    # and every member merges the same, exact mean.
    size, seeds = 1_200_000, [51, 52, 53]
    logs = [tmp_path / f"member-{seed}.log" for seed in seeds]
    options = ["--chunk-timeout", "10", "--lanes", "off" if lanes == "off" else "on"]
    options += ["--uplink-mbit", "400" if lanes == "paced" else "0"]
    first = members.start(seeds[0], size, 3, [], *options, log=logs[0])
    members.start(seeds[1], size, 3, [first.maddr], *options, log=logs[1])
    members.start(seeds[2], size, 3, [first.maddr], *options, "--cut-replies-after", "1", log=logs[2])
    members.go()
    results = [members.result(process) for process in members.processes]
    mean = _true_mean(seeds, size)
    tails = "\n\n".join(log.read_text()[-3000:] for log in logs)
    assert all(result["merged"] is not None for result in results), (results, tails)
    for result in results:
        assert result["merged"]["sum"] == pytest.approx(float(mean.double().sum()), abs=1e-2)
        torch.testing.assert_close(torch.tensor(result["merged"]["first"]), mean[:4], atol=1e-6, rtol=0)
    assert len({json.dumps(result["merged"]) for result in results}) == 1, "members ended with different bits"
    texts = [log.read_text() for log in logs]
    cut = re.compile(r"reply stream ended after 1 of [2-9] parts; asking again")
    assert sum(bool(cut.search(text)) for text in texts[:2]) == 1, texts
    assert sum("sent the missing parts again: the round is complete" in text for text in texts[:2]) == 1
    assert "parts 1.. of its round again" in texts[2]
    # One repair per round attempt: a loaded machine may retry a group attempt that fell through after its repair.
    assert sorted(min(result["repairs"], 1) for result in results[:2]) == [0, 1] and results[2]["repairs"] == 0
    # Lanes opened so far (a loaded machine's member may have opened one more in a group attempt that fell through).
    assert all((result["lanes"] >= 2) if lanes != "off" else (result["lanes"] == 0) for result in results), results


def test_group_applies_the_staleness_rule_against_its_robust_clock(members: Members) -> None:
    # Steps 10, 9 and 4 with max_staleness 3 and discount 0.5: the group's clock is its 2nd highest step (9, so no
    # single member sets it): weights 1, 1 and 0 (rejected), computed alike by every member although the stale
    # one's own view of the swarm said it was current.
    size, seeds, steps = 50_000, [31, 32, 33], [10, 9, 4]
    first = members.start(seeds[0], size, 3, [], "--outer-step", str(steps[0]))
    for seed, step in zip(seeds[1:], steps[1:]):
        members.start(seed, size, 3, [first.maddr], "--outer-step", str(step))
    members.go()
    results = [members.result(process) for process in members.processes]
    expected = (member_vector(seeds[0], size) + member_vector(seeds[1], size)) / 2
    merged = [result["merged"] for result in results if result["merged"] is not None]
    assert len(merged) >= 2, results
    for result in merged:
        assert result["sum"] == pytest.approx(float(expected.double().sum()), abs=1e-2)
        torch.testing.assert_close(torch.tensor(result["first"]), expected[:4], atol=1e-6, rtol=0)
    assert len({json.dumps(result) for result in merged}) == 1, "members ended with different bits"


def test_members_exchanging_different_fragments_never_average(members: Members) -> None:
    size = 20_000
    first = members.start(41, size, 2, [], "--schema-tag", "0", "--timeout", "6")
    members.start(42, size, 2, [first.maddr], "--schema-tag", "1", "--timeout", "6")
    members.go()
    results = [members.result(process) for process in members.processes]
    assert all(result["merged"] is None for result in results), results
    assert all(result["restored"] for result in results), results


def test_member_killed_mid_round_never_leaves_a_partial_average(members: Members) -> None:
    size, seeds = 2_000_000, [11, 12, 13]
    first = members.start(seeds[0], size, 3, [], "--timeout", "12")
    survivor = members.start(seeds[1], size, 3, [first.maddr], "--timeout", "12")
    victim = members.start(seeds[2], size, 3, [first.maddr], "--timeout", "12")
    members.go()
    assert victim.stdout.readline().strip() == "ALLREDUCE"
    kill_process_tree(victim.pid, signal.SIGKILL)
    full_mean = float(_true_mean(seeds, size).double().sum())
    outcomes = []
    for process in (first, survivor):
        result = members.result(process)
        if result["merged"] is None:
            assert result["restored"], "a discarded round must leave the island's own pseudo-gradient intact"
            outcomes.append("discarded")
        else:  # the victim had sent everything before it died: a complete average is valid
            assert result["merged"]["sum"] == pytest.approx(full_mean, abs=1e-1)
            outcomes.append("complete")
    print("survivor outcomes:", outcomes)
    assert len(set(outcomes)) == 1, f"survivors disagree on the round: {outcomes}"


def test_a_member_frozen_mid_round_gives_up_once_a_reducer_failed(members: Members, tmp_path: Path) -> None:
    # A member frozen (SIGSTOP) mid-round wakes to find reducers gone: the round is lost to it whatever else arrives,
    # so it gives up within its chunk timeout instead of waiting out the 30 s all-reduce timeout, and keeps its own
    # pseudo-gradient. (Measured before: 32.7 s for a 5-member group with a member killed beside the frozen one.)
    size, seeds = 2_000_000, [81, 82, 83]
    log = tmp_path / "frozen.log"
    first = members.start(seeds[0], size, 3, [], "--timeout", "8")
    survivor = members.start(seeds[1], size, 3, [first.maddr], "--timeout", "8")
    frozen = members.start(seeds[2], size, 3, [first.maddr], "--timeout", "8", log=log)
    members.go()
    assert frozen.stdout.readline().strip() == "ALLREDUCE"
    os.killpg(frozen.pid, signal.SIGSTOP)
    try:
        outcomes = [members.result(process) for process in (first, survivor)]
    finally:
        os.killpg(frozen.pid, signal.SIGCONT)
    woke = time.monotonic()
    result = members.result(frozen)
    waited = time.monotonic() - woke
    assert result["merged"] is None and result["restored"], result
    assert all(outcome["merged"] is None and outcome["restored"] for outcome in outcomes), outcomes
    # It wakes either to its reducer's failure (and gives up once the chunk timeout passes) or, on a loaded machine,
    # to the others' results streams already closed (a partial result, discarded at once): never the full timeout.
    text = log.read_text()
    assert any(sign in text for sign in ("gave up on the rest", "the round is lost", "% results")), text[-2000:]
    assert waited < 20, f"the woken member waited {waited:.0f} s for a round it had lost: the all-reduce timeout"


def test_nan_from_a_peer_is_never_applied(members: Members) -> None:
    size = 50_000
    healthy = members.start(21, size, 2, [], "--timeout", "12")
    members.start(22, size, 2, [healthy.maddr], "--nan", "--timeout", "12")
    members.go()
    results = [members.result(process) for process in members.processes]
    assert all(result["merged"] is None for result in results)
    assert results[0]["restored"]


def test_parts_are_sized_for_the_group_alike_on_every_member() -> None:
    from p2p_diloco.net.codecs import get_compression
    from p2p_diloco.net.parts import MAX_PART_VALUES, MIN_PART_VALUES, PARTS_PER_REDUCER, part_size_for

    fp32 = get_compression("fp32")
    assert part_size_for([torch.zeros(1000)], 4, fp32) == 4 * MIN_PART_VALUES  # small vectors: hivemind's 512 KiB
    assert part_size_for([torch.zeros(10**9)], 2, fp32) == 4 * MAX_PART_VALUES  # capped for slow links
    middle = 4 * PARTS_PER_REDUCER * (4 * MIN_PART_VALUES)  # parts of 4x the smallest in a group of 4
    assert part_size_for([torch.zeros(middle)], 4, fp32) == 4 * (4 * MIN_PART_VALUES)
    # Counted after compression, as hivemind's part_size_bytes is: an int8 part holds as many values as fp32's.
    from hivemind.compression import CompressionInfo

    int8, vector = get_compression("int8"), torch.zeros(10**8)
    ratio = int8.estimate_compression_ratio(CompressionInfo.from_tensor(vector))
    values = part_size_for([vector], 4, int8) / (4 * ratio)
    assert values == pytest.approx(part_size_for([vector], 4, fp32) / 4, rel=1e-3)


def test_parts_shrink_to_the_slowest_members_measured_rate_and_ignore_garbage() -> None:
    from p2p_diloco.net.codecs import get_compression
    from p2p_diloco.net.parts import MIN_PART_VALUES, PART_SECONDS, part_bytes_per_window, part_size_for

    fp32, vector = get_compression("fp32"), torch.zeros(10**8)
    fast = part_size_for([vector], 2, fp32)
    slow_link = part_bytes_per_window(bytes_sent=20e6, seconds=3.4)  # 100 Mbit/s
    assert slow_link == int(20e6 / 3.4 * PART_SECONDS)
    assert part_size_for([vector], 2, fp32, [None, 10**12, slow_link]) == 4 * MIN_PART_VALUES < fast
    assert part_size_for([vector], 2, fp32, [8 * MIN_PART_VALUES * 4]) == 8 * MIN_PART_VALUES * 4
    for garbage in (["x"], [True], [-5], [float("nan")], [0], [{}]):
        assert part_size_for([vector], 2, fp32, garbage) == fast, garbage
    assert part_bytes_per_window(0, 1.0) is None and part_bytes_per_window(10, 0.0) is None


def test_a_poisoned_part_dooms_the_round_at_once() -> None:
    # A reducer that lost a sender returns NaN parts: the round will be discarded whatever else arrives, so the
    # member stops waiting for slower (perhaps frozen) reducers once its grace runs out.
    import asyncio
    from types import SimpleNamespace

    import torch

    from p2p_diloco.net.allreduce import StrictAllReduceRunner
    from p2p_diloco.net.pacing import OwnPartsOut

    registered = []

    class Container:
        def register_processed_part(self, peer_index: int, part_index: int, part: torch.Tensor) -> None:
            registered.append((peer_index, part_index))

    runner = object.__new__(StrictAllReduceRunner)
    runner.doomed, runner.tensor_part_container, runner.ordered_peer_ids = asyncio.Event(), Container(), ["a", "b"]
    runner.poisoned = False
    runner.tensor_part_reducer, runner._senders_connected = SimpleNamespace(poisoned=False), {}
    runner.own_parts = OwnPartsOut([1])  # its parts for reducer 1 are still going out
    runner._register_part(0, 0, torch.full((4,), 3e38))  # overflows its sum, yet every value is finite
    assert not runner.doomed.is_set() and not runner.poisoned
    runner._register_part(1, 0, torch.tensor([1.0, float("nan")]))
    assert runner.doomed.is_set() and runner.poisoned and registered == [(0, 0), (1, 0)]
    # The round is lost to this member, so its own reducer returns poison from now on: the group agrees at once,
    # and a paced member no longer holds its (poisoned) replies back for its own parts.
    assert runner.tensor_part_reducer.poisoned and runner.own_parts.event.is_set()
