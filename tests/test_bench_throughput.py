"""The throughput benchmark's smoke mode runs end to end and writes the figures the issue names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks_path import BENCHMARKS


def test_throughput_smoke(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "throughput.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "throughput-smoke.json").read_text())
    assert 0 < data["ratio_vs_plain_loop"] < 10
    assert [row["size"] for row in data["rows"]] == ["1M", "10M"]
    assert data["rows"][0]["params"] < data["rows"][1]["params"]
    assert all(row["outer_step_ms"] > 0 for row in data["rows"])
