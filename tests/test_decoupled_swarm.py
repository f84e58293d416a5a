"""Decoupled behaviour with real processes: a stalled island never holds the others back."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from conftest import LocalSwarm, wait_until

REPO = Path(__file__).resolve().parents[1]


def test_stalled_island_rejoins_and_others_keep_stepping(local_swarm: LocalSwarm) -> None:
    local_swarm.bootstrap()
    # The others stop waiting for a frozen island after a few rounds (--expect-rounds) and run ahead. They run 8 steps
    # past the stalled island's last one, so the woken island has partners until it ends however long its catch-up
    # takes (a loaded machine may need several rounds: a download from donors whose connections to the frozen process
    # time out first can fail, and the next stale round retries).
    args = ["--num-shards", "3", "--max-staleness", "3", "--next-chunk-timeout", "2"]
    outer_steps = ["32", "40", "40"]
    peers = [
        local_swarm.peer(f"island-{i}", "--shard-index", str(i), "--outer-steps", outer_steps[i], *args)
        for i in range(3)
    ]
    stalled = peers[0]
    wait_until(lambda: len(stalled.records()) >= 2, 180, "two outer steps of the island to stall")
    stalled.signal_group(signal.SIGSTOP)  # freeze the island, its averager, DHT and p2pd
    try:
        frozen_at = len(stalled.records())
        running_at = len(peers[1].records())
        wait_until(lambda: len(peers[1].records()) >= running_at + 5, 120, "the others to step while one is stalled")
        assert len(stalled.records()) == frozen_at
        # ...and merge with each other: a frozen island's DHT node and averager must not hold up their look-ups
        # and all-reduces (with hivemind's 3 s DHT request timeout they merged nothing until it woke).
        during = peers[1].records()[running_at:]
        assert sum(r["partners"] > 0 for r in during) >= 3, [(r["partners"], r["note"]) for r in during]
    finally:
        stalled.signal_group(signal.SIGCONT)
    for peer in peers:
        assert peer.wait(240) == 0, peer.log_text()[-3000:]
    timelines = {peer.name: [(r["outer_step"], r["partners"], r["resynced"]) for r in peer.records()] for peer in peers}

    after = stalled.records()[frozen_at:]
    # Its stale contribution never reaches the others' anchors: the group rejects it (its view shows the swarm ahead),
    # or, paired with one island while its view is too young to doubt, that island discards the round, and the woken
    # one resyncs when the digests differ. The download may need a round (donors' connections to a process that was
    # frozen time out first), so the catch-up is the first round after the freeze that resynced.
    for peer in peers[1:]:
        for r in peer.records():
            if r["merged"]:  # staleness and merge_weights list this island, then its partners, in one order
                weighed = zip(r["staleness"][1:], r["merge_weights"][1:])
                lags = [lag - r["staleness"][0] for lag, weight in weighed if weight]
                assert max(lags, default=0) <= 3, f"{peer.name} weighed a contribution {max(lags)} steps behind it"
    caught_up = [r for r in after if r["resynced"]]
    seen = [(r["outer_step"], r["partners"], r["resynced"], r["note"]) for r in after]
    assert caught_up, f"the stalled island never caught up: {seen}"
    assert any(r["partners"] > 0 for r in after), (
        f"the stalled island never merged again after SIGCONT: {seen} {timelines}"
    )
    steps = {}
    for peer in peers:
        for record in peer.records():
            steps.setdefault(record["outer_step"], {})[peer.name] = record
    rejoined = [
        step
        for step, records in steps.items()
        if step > caught_up[0]["outer_step"] and len(records) == 3 and all(r["partners"] == 2 for r in records.values())
    ]
    for step in rejoined:
        assert len({r["anchor_digest"] for r in steps[step].values()}) == 1
    assert rejoined, "no all-island round after the stalled island came back"


def test_decoupled_benchmark_smoke(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "decoupled.py"), "--smoke", "--budget", "8", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    import json

    data = json.loads((tmp_path / "decoupled-smoke.json").read_text())
    assert {"command", "date", "machine", "rows"} <= set(data)
    for row in data["rows"]:
        assert {"mode", "merge", "final_eval_loss", "goodput", "blocked_fraction"} <= set(row)
        assert row["goodput"] > 0 and len(row["final_eval_loss"]) == 4
    assert (tmp_path / "decoupled-smoke.png").read_bytes()[:4] == b"\x89PNG"


def test_stalled_streaming_island_realigns_its_fragments(local_swarm: LocalSwarm) -> None:
    local_swarm.bootstrap()
    args = ["--inner-steps", "10", "--num-shards", "3", "--fragments", "2", "--overlap-steps", "2"]
    args += ["--next-chunk-timeout", "2"]
    # The others run 16 steps past the stalled island's end: two islands alone step in 0.2 s, and on a loaded host
    # a woken process took 14 s to come back, when 24 steps had already ended the swarm it would have realigned with.
    outer_steps = ["40", "40", "24"]
    peers = [
        local_swarm.peer(f"island-{i}", "--shard-index", str(i), "--outer-steps", outer_steps[i], *args)
        for i in range(3)
    ]
    stalled = peers[2]
    wait_until(lambda: len(stalled.records()) >= 4, 180, "four rounds of the island to stall")
    stalled.signal_group(signal.SIGSTOP)
    try:
        frozen_at, running_at = len(stalled.records()), len(peers[0].records())
        # A lag of 2 or 3 steps: within max_staleness, and of either parity against P = 2 fragments
        wait_until(lambda: len(peers[0].records()) >= running_at + 3, 120, "the others to step while one is stalled")
    finally:
        stalled.signal_group(signal.SIGCONT)
    for peer in peers:
        assert peer.wait(240) == 0, peer.log_text()[-3000:]

    after = stalled.records()[frozen_at:]
    rounds = [(r["outer_step"], r["fragment"], r["partners"], r["merged"], r["resynced"], r["note"]) for r in after]
    assert any(r["resynced"] for r in after), f"the stalled island never resynced its fragments: {rounds}"
    steps = {}
    for peer in peers:
        for record in peer.records():
            steps.setdefault(record["outer_step"], {})[peer.name] = record
    full = {
        step
        for step, records in steps.items()
        if len(records) == 3 and all(r["partners"] == 2 and r["merged"] for r in records.values())
    }
    realigned = sorted(step for step in full if step > after[0]["outer_step"])
    assert realigned, "the stalled island never merged with both others again"
    # A merge (with its resync, if any) aligns its fragment on every member: after P = 2 consecutive rounds that all
    # three merged, every fragment's last exchange was such a round and the islands hold the same state. A failed
    # round in between leaves each island's own update on its fragment until that fragment's next merge realigns it
    # (a CI run ended with three states after an all-island last round: its next-to-last round, by elimination).
    # (From every record: a round that lands nothing after a resync keeps its outer step and its record that step's.)
    settled = [step for step in realigned if step - 1 in full]
    assert settled, f"never two all-island rounds in a row after the stall: {sorted(full)}"
    for step in settled:
        assert len({r["anchor_digest"] for r in steps[step].values()}) == 1, f"islands differ after step {step}"
    assert [peer.records()[-1]["outer_step"] for peer in peers] == [40, 40, 24]


def test_a_plain_decoupled_run_carries_the_extended_rows_over_dated_in_config_order(tmp_path: Path) -> None:
    import json

    sys.path.insert(0, str(REPO / "benchmarks"))
    from decoupled import EXTENDED_CONFIGS, carry_over

    old_rows = [{"name": name, "goodput": 1.0} for name in ("sync", "k1-nograce-mean", "k1-adaptive-tokens-delayed")]
    previous = tmp_path / "decoupled.json"
    previous.write_text(json.dumps({"date": "2026-12-03T04:56:41", "budget_s": 30, "rows": old_rows}))
    fresh = [{"name": "sync", "goodput": 2.0}, {"name": "k1-adaptive-tokens", "goodput": 3.0}]
    rows, carried = carry_over(fresh, previous, EXTENDED_CONFIGS, 30)
    assert [row["name"] for row in rows] == [
        "sync",
        "k1-nograce-mean",
        "k1-adaptive-tokens",
        "k1-adaptive-tokens-delayed",
    ]
    assert rows[0]["goodput"] == 2.0, "a fresh row must win over the carried one"
    assert carried == {"k1-nograce-mean": "2026-12-03T04:56:41", "k1-adaptive-tokens-delayed": "2026-12-03T04:56:41"}
    # Carried twice, a row keeps the date it was measured on; another budget carries nothing.
    previous.write_text(json.dumps({"date": "2026-12-06", "budget_s": 30, "rows": rows, "carried_over": carried}))
    assert carry_over(fresh, previous, EXTENDED_CONFIGS, 30)[1] == carried
    assert carry_over(fresh, previous, EXTENDED_CONFIGS, 15) == (fresh, {})
