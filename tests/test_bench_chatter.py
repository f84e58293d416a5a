"""The chatter benchmark's smoke mode counts a real swarm's RPCs and charges them to what they served."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks_path import BENCHMARKS


def test_chatter_smoke_names_where_the_bytes_go(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "chatter.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:] + "\n--- stdout:\n" + result.stdout[-2000:]
    data = json.loads((tmp_path / "chatter-smoke.json").read_text())
    assert data["island_rounds_counted"] >= 2
    kinds = set(data["chatter_by_what"])
    # every round of two islands looks up and declares its group, and they announce themselves at least once
    assert {"matchmaking (group keys)", "island records (announce)"} <= kinds, kinds
    assert data["rpc_bytes_per_island_round"] == sum(row["bytes_per_island_round"] for row in data["rows"])
    assert all(row["calls"] > 0 and row["bytes"] > 0 for row in data["rows"])
    assert data["payload_bytes_per_island_round"] > 0
    # The same swarm walking the DHT for every read and write, as hivemind does, costs more.
    walks = data["hivemind_walks"]
    assert (
        walks["island_rounds_counted"] >= 2 and walks["rpc_bytes_per_island_round"] > data["rpc_bytes_per_island_round"]
    )
    assert data["replica_first_vs_walks"] < 1
    assert (tmp_path / "chatter-smoke.png").read_bytes()[:4] == b"\x89PNG"
