"""The restart benchmark's smoke mode runs end to end: an island restarted with and without the start-up
shortcuts resumes, rejoins and merges both ways."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks_path import BENCHMARKS


def test_restart_smoke(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "restart.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "restart-smoke.json").read_text())
    assert [row["way"] for row in data["restarts"]] == ["shipped", "plain", "standby"]
    for row in data["restarts"]:  # each restart resumed, rejoined and merged: every phase took time
        assert row["process_start_s"] > 0 and row["join_s"] > 0 and row["restore_s"] > 0, row
        assert row["first_round_s"] > 0 and row["total_over_restore"] > 1, row
    assert set(data["shipped_over_plain"]) == {"import_s", "process_start_s", "join_s", "total_s"}
    assert set(data["standby_over_shipped"]) == {"total_s", "total_over_restore"}
    assert set(data["imports_s"]) == {"shipped", "plain"}
    assert all(len(times) == 1 and times[0] > 0 for times in data["imports_s"].values())
    assert (tmp_path / "restart-smoke.png").stat().st_size > 0
