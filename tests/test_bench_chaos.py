"""The chaos benchmark's smoke mode runs end to end, so the benchmark cannot silently rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks_path import BENCHMARKS
from chaos import Schedule  # noqa: E402


def test_schedule_is_seeded_and_never_hits_a_down_island() -> None:
    first = Schedule.make(seed=3, islands=4, budget=100, kill_every=20, restart_after=8, stop_every=25, stop_for=6)
    again = Schedule.make(seed=3, islands=4, budget=100, kill_every=20, restart_after=8, stop_every=25, stop_for=6)
    assert first.events == again.events and any(action == "kill" for _, action, _ in first.events)
    down: dict[int, str] = {}
    for _, action, island in first.events:
        if action in ("kill", "stop"):
            assert island not in down, f"island {island} hit while already {down[island]}"
            down[island] = action
        else:
            down.pop(island)


def test_chaos_smoke(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "chaos.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "chaos-smoke.json").read_text())
    assert set(data["goodput"]) == {"decoupled", "synchronous"}
    assert all(value > 0 for value in data["goodput"].values())
    assert data["unexpected_errors"]["decoupled"] == [], data["unexpected_errors"]
    assert any(run["kills"] > 0 for run in data["runs"])
