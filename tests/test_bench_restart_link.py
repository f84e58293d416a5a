"""The restart-over-a-link benchmark: an island on a host of its own, its uplink shaped, is killed, restarts,
downloads the swarm's state over the link and merges again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import benchmarks_path  # noqa: F401
import pytest
from benchmarks_path import BENCHMARKS
from lib.netns import available

REASON = available()


@pytest.mark.skipif(REASON is not None, reason=f"separate hosts need network namespaces: {REASON}")
def test_restart_link_smoke(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "restart_link.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "restart_link-smoke.json").read_text())
    assert [(row["size"], row["codec"]) for row in data["restarts"]] == [("tiny", "fp32")]
    for row in data["restarts"]:  # it restarted, joined, downloaded the state and merged: each phase took time
        assert row["process_start_s"] > 0 and row["join_s"] > 0 and row["restore_s"] > 0, row
        assert row["first_round_s"] > 0 and row["total_s"] > row["restore_s"], row
    figures = data["configs"]["tiny fp32"]
    assert figures["state_bytes"] > 0 and figures["transfer_limit_s"] > 0
    assert figures["total_over_transfer_limit"] == pytest.approx(figures["total_s"] / figures["transfer_limit_s"])


def test_a_plain_run_carries_the_extended_configurations_over(tmp_path: Path) -> None:
    from restart_link import carry_over

    previous = {
        "date": "2026-12-01T00:00:00+00:00",
        "rate_mbit": 100.0,
        "configs": {"10M int8": {"total_s": 1.0}, "38M int8": {"total_s": 2.0}},
        "restarts": [{"size": "10M", "codec": "int8"}, {"size": "38M", "codec": "int8"}],
    }
    (tmp_path / "restart_link.json").write_text(json.dumps(previous))
    result = {
        "rate_mbit": 100.0,
        "configs": {"10M int8": {"total_s": 3.0}},
        "restarts": [{"size": "10M", "codec": "int8"}],
    }
    carry_over(result, tmp_path / "restart_link.json")
    assert result["configs"] == {"10M int8": {"total_s": 3.0}, "38M int8": {"total_s": 2.0}}
    assert result["restarts"] == [{"size": "10M", "codec": "int8"}, {"size": "38M", "codec": "int8"}]
    assert result["carried_over"] == {"38M int8": "2026-12-01T00:00:00+00:00"}
    other_rate = {"rate_mbit": 1000.0, "configs": {}, "restarts": []}
    carry_over(other_rate, tmp_path / "restart_link.json")  # another link's figures are not this one's
    assert other_rate["configs"] == {} and "carried_over" not in other_rate
