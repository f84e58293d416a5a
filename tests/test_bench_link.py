"""The link benchmark: islands on separate hosts with shaped uplinks; a round cannot beat the link."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import benchmarks_path  # noqa: F401
import pytest
from lib.netns import available

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "link.py"
ROW_KEYS = {"islands", "codec", "rate_mbit", "payload_bytes", "seconds_per_round", "ratio_to_limit"}
REASON = available()


def test_the_limit_is_a_bandwidth_optimal_all_reduce() -> None:
    from link import limit_seconds, payload_bytes

    assert payload_bytes("fp32", 10_000_000) == 40_000_000
    assert payload_bytes("int8", 10_000_000) < 11_000_000
    assert limit_seconds(40_000_000, 2, 100) == pytest.approx(3.2)  # each island uploads the whole payload once
    assert limit_seconds(40_000_000, 4, 100) == pytest.approx(4.8)  # 2 x 3/4 of it


@pytest.mark.skipif(REASON is not None, reason=f"separate hosts need network namespaces: {REASON}")
def test_link_benchmark_smoke(tmp_path: Path) -> None:
    bench = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )
    try:
        output, _ = bench.communicate(timeout=400)
    finally:
        if bench.poll() is None:
            bench.terminate()  # its finally blocks stop the islands and delete the namespaces
            bench.communicate(timeout=60)
    assert bench.returncode == 0, output[-5000:]
    result = json.loads((tmp_path / "link-smoke.json").read_text())
    rows = {row["system"]: row for row in result["rows"]}
    assert set(rows) == {"gloo", "p2p_diloco"}
    for row in rows.values():
        assert ROW_KEYS <= set(row), row
        assert row["correct"] is True, row
        assert (row["islands"], row["rate_mbit"], row["payload_bytes"]) == (2, 100.0, 4_000_000)
        # The shaping holds: 4 MB each way at 100 Mbit/s takes at least the link's time, whoever sends it.
        assert row["ratio_to_limit"] > 0.9, row
    ours = rows["p2p_diloco"]
    assert ours["bytes_sent_per_peer_per_round"] == pytest.approx(4_000_000, rel=0.01)
    assert ours["wire_bytes_per_peer_per_round"] > ours["bytes_sent_per_peer_per_round"]
    assert isinstance(ours["streams_repaired"], int) and ours["streams_repaired"] >= 0
    assert (tmp_path / "link-smoke.png").stat().st_size > 0
    ours_prefix = f"pd{bench.pid % 10000}"  # lib.netns names every namespace after the creating process
    leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not [name for name in leftover if name.startswith(ours_prefix)], leftover
