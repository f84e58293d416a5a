"""Direct lanes' heartbeats: a live but idle end keeps its lane, a silent (frozen) one loses it within seconds."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from members import Members

from p2p_diloco.net.direct import FRAME, HEARTBEAT, RAW_FP32, TO_REDUCER, TO_SENDER, Lane, LaneError, LaneSilent

KEY = bytes(range(16))
BEAT, SILENCE = 0.05, 1.0  # a silence 20 beats long: a loaded CI host may stall this process for a while


def _pair(**timing) -> tuple[Lane, Lane]:
    left, right = socket.socketpair()
    for sock in (left, right):
        sock.setblocking(False)
    return Lane(left, KEY, outgoing=TO_REDUCER, **timing), Lane(right, KEY, outgoing=TO_SENDER, **timing)


def test_heartbeats_keep_an_idle_lane_open_and_count_as_wire_bytes() -> None:
    async def scenario() -> None:
        sender, reducer = _pair(heartbeat_s=BEAT, silence_s=SILENCE)
        # The reducer waits for a part that comes after many silence windows: the sender's heartbeats keep it.
        waiting = asyncio.create_task(reducer.receive(0, 8))
        await asyncio.sleep(3 * SILENCE)
        assert not waiting.done()
        await sender.send(0, RAW_FP32, b"\x01" * 8, 1.0)
        kind, weight, payload = await asyncio.wait_for(waiting, 5.0)
        assert (kind, weight, bytes(payload.numpy())) == (RAW_FP32, 1.0, b"\x01" * 8)
        beats = (sender.bytes_sent - (FRAME.size + 8 + 16)) // (FRAME.size + 16)
        assert beats >= 4 and sender.bytes_sent == reducer.bytes_received
        # Heartbeats after the last frame are skipped by the wait for the other end's close.
        closing = asyncio.create_task(reducer.wait_closed())
        await asyncio.sleep(4 * BEAT)
        assert not closing.done()
        sender.close()
        await asyncio.wait_for(closing, 5.0)
        reducer.close()

    asyncio.run(scenario())


def test_a_silent_end_ends_the_lane_and_a_send_blocked_on_it() -> None:
    async def scenario() -> None:
        left, frozen = socket.socketpair()  # `frozen` never reads nor writes: a SIGSTOPped island's socket
        left.setblocking(False)
        lane = Lane(left, KEY, outgoing=TO_REDUCER, heartbeat_s=BEAT, silence_s=SILENCE)
        # A send larger than both socket buffers blocks on the frozen end's full receive window.
        blocked = asyncio.create_task(lane.send(0, RAW_FP32, bytes(64 << 20), 1.0))
        started = time.monotonic()
        with pytest.raises(LaneSilent):
            await asyncio.wait_for(lane.receive(0, 8), 10 * SILENCE)
        assert time.monotonic() - started >= SILENCE * 0.9
        with pytest.raises(OSError):
            await asyncio.wait_for(blocked, 10 * SILENCE)
        lane.close()
        frozen.close()

    asyncio.run(scenario())


def test_a_heartbeat_out_of_order_or_forged_ends_the_lane() -> None:
    async def scenario(header: bytes, tag: bytes, match: str) -> None:
        inbound, outbound = socket.socketpair()
        inbound.setblocking(False)
        outbound.sendall(header + tag)
        lane = Lane(inbound, KEY, outgoing=TO_SENDER, heartbeat_s=60.0, silence_s=5.0)
        with pytest.raises(LaneError, match=match):
            await lane.receive(0, 8)
        lane.close()
        outbound.close()

    asyncio.run(scenario(FRAME.pack(7, HEARTBEAT, 0, 0.0), bytes(16), "expected heartbeat 0"))
    asyncio.run(scenario(FRAME.pack(0, HEARTBEAT, 0, 0.0), bytes(16), "authentication tag"))
    asyncio.run(scenario(FRAME.pack(0, HEARTBEAT, 5, 0.0), bytes(16), "5 bytes"))


CHUNK_TIMEOUT = 15.0
"""Without liveness checks the survivors of a freeze would wait at least this long (their chunk timeout)."""


def _frozen_round(members: Members, logs: list[Path], fault: tuple[str, ...]) -> tuple[subprocess.Popen, list]:
    size, seeds = 2_000_000, [91, 92, 93]
    extra = ("--timeout", "8", "--chunk-timeout", str(CHUNK_TIMEOUT), "--no-retries")
    first = members.start(seeds[0], size, 3, [], *extra, log=logs[0])
    members.start(seeds[1], size, 3, [first.maddr], *extra, log=logs[1])
    members.start(seeds[2], size, 3, [first.maddr], *extra, *fault, log=logs[2])
    members.go()
    return members.processes[2], members.processes[:2]


def _result_now(process: subprocess.Popen) -> tuple[dict, float]:
    """A member's RESULT, and when it came (before the member's own shutdown, which takes seconds)."""
    for line in process.stdout:
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :]), time.monotonic()
    pytest.fail(f"member exited without a result (code {process.wait()})")


def _survivors_gave_up(members: Members, survivors: list, frozen: subprocess.Popen, froze: float) -> float:
    """Seconds from the freeze to the later of both survivors' results (the frozen member is woken after)."""
    try:
        results = [_result_now(process) for process in survivors]
    finally:
        os.killpg(frozen.pid, signal.SIGCONT)
    waited = max(when for _, when in results) - froze
    print(f"survivors gave up {waited:.1f} s after the freeze")
    outcomes = [outcome for outcome, _ in results]
    assert all(outcome["merged"] is None and outcome["restored"] for outcome in outcomes), outcomes
    woke = time.monotonic()
    assert _result_now(frozen)[0]["merged"] is None
    woken_waited = time.monotonic() - woke
    print(f"the frozen member gave up {woken_waited:.1f} s after it woke")
    # Its partners are gone: it must not wait for senders that will never come (the chunk timeout).
    assert woken_waited < CHUNK_TIMEOUT, f"the woken member waited {woken_waited:.1f} s for partners long gone"
    return waited


def test_partners_of_an_averager_frozen_mid_transfer_hear_its_lanes_fall_silent(
    members: Members, tmp_path: Path
) -> None:
    logs = [tmp_path / f"member{index}.log" for index in range(3)]
    frozen, survivors = _frozen_round(members, logs, ("--freeze-after-frames", "2"))
    while (line := frozen.stdout.readline()) and line.strip() != "FROZEN":
        pass
    assert line, "the member exited before its averager froze"
    waited = _survivors_gave_up(members, survivors, frozen, time.monotonic())
    text = "".join(log.read_text() for log in logs[:2])
    assert "LaneSilent" in text or "fell silent" in text, text[-3000:]
    assert waited < CHUNK_TIMEOUT, f"survivors waited {waited:.1f} s for a frozen member: the chunk timeout"


def test_partners_of_a_member_frozen_entering_the_round_give_up_within_seconds(
    members: Members, tmp_path: Path
) -> None:
    # Frozen whole (host, averager, daemons) as the round starts: before or after it answered its partners'
    # ticket requests, they give up on it within seconds, and all alike.
    logs = [tmp_path / f"member{index}.log" for index in range(3)]
    frozen, survivors = _frozen_round(members, logs, ())
    assert frozen.stdout.readline().strip() == "ALLREDUCE"
    os.killpg(frozen.pid, signal.SIGSTOP)
    waited = _survivors_gave_up(members, survivors, frozen, time.monotonic())
    text = "".join(log.read_text() for log in logs[:2])
    assert any(sign in text for sign in ("LaneSilent", "fell silent", "answered nothing")), text[-3000:]
    assert waited < CHUNK_TIMEOUT, f"survivors waited {waited:.1f} s for a frozen member: the chunk timeout"
