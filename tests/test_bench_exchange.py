"""The exchange benchmark's smoke mode: every system averages 1M values between 2 peer processes, correctly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "exchange.py"
ROW_KEYS = {"values", "peers", "system", "seconds", "gb_per_s", "ratio_to_gloo", "correct"}


def test_exchange_benchmark_smoke(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    result = json.loads((tmp_path / "exchange-smoke.json").read_text())
    assert {"command", "date", "machine", "rows", "profile"} <= set(result)
    rows = result["rows"]
    assert {row["system"] for row in rows} == {"p2p_diloco", "hivemind", "gloo"}
    pairs = {(row["system"], row["codec"]) for row in rows}
    assert pairs == {("gloo", "fp32"), *((s, c) for s in ("hivemind", "p2p_diloco") for c in ("fp32", "int8"))}
    for row in rows:
        assert ROW_KEYS <= set(row), row
        assert (row["values"], row["peers"]) == (1_000_000, 2)
        if row["system"] == "hivemind" and not row["correct"]:  # the baseline may lose a round; it must say so
            assert row.get("failures") or row.get("error"), row
            continue
        assert row["correct"] is True, row
        assert row["seconds"] > 0
        assert row["gb_per_s"] == pytest.approx(row["values"] * 4 / row["seconds"] / 1e9)
        assert row["ratio_to_gloo"] > 0
    assert next(row for row in rows if row["system"] == "gloo")["ratio_to_gloo"] == pytest.approx(1.0)
    assert (tmp_path / "exchange-smoke.png").stat().st_size > 0
    costs = result["codec_ms_per_million"]  # the codec's CPU beside the round it is part of
    assert set(costs) == {"int8", "int4", "int2", "hivemind_int8"}
    assert all(c["encode"] > 0 and c["decode"] > 0 for c in costs.values())
    int8 = next(row for row in rows if (row["system"], row["codec"]) == ("p2p_diloco", "int8"))
    assert int8["codec_s_estimate"] == pytest.approx((costs["int8"]["encode"] + costs["int8"]["decode"]) / 1e3)
    stock = next(row for row in rows if (row["system"], row["codec"]) == ("hivemind", "int8"))  # hivemind's own codec
    assert stock["codec_s_estimate"] == pytest.approx(sum(costs["hivemind_int8"].values()) / 1e3)
