"""The bandwidth, sparse-horizon and utilization benchmarks' smoke modes, so they cannot silently rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import benchmarks_path  # noqa: F401
from utilization import compute_fraction

REPO = Path(__file__).resolve().parents[1]


def _run(script: str, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), "--smoke", "--out", str(tmp_path), *extra],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )


def test_bandwidth_benchmark_smoke(tmp_path: Path) -> None:
    completed = _run("bandwidth.py", tmp_path)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    result = json.loads((tmp_path / "bandwidth-smoke.json").read_text())
    assert {"H", "ratio_vs_data_parallel", "final_eval_loss", "command", "date", "machine"} <= set(result)
    ratios = result["ratio_vs_data_parallel"]
    assert set(ratios) == {"fp32", "int8", "topk"} == set(result["tcp_over_payload"])
    # 2 islands send about 1 value per value and round; int8 about a quarter of fp32's bytes
    assert ratios["fp32"] > 1 and 3.0 < ratios["int8"] / ratios["fp32"] < 4.1, ratios
    assert ratios["topk"] / ratios["fp32"] > 30, ratios  # 2% of the values at about 10 bits each
    for row in result["rows"]:
        assert row["merged_rounds"] > 0 and row["transport_bytes_per_token"] > row["payload_bytes_per_token"]
    assert (tmp_path / "bandwidth-smoke.png").stat().st_size > 0


def test_sparse_horizon_benchmark_smoke(tmp_path: Path) -> None:
    completed = _run("sparse_horizon.py", tmp_path, "--rounds", "2")
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    result = json.loads((tmp_path / "sparse_horizon-smoke.json").read_text())
    curves = result["eval_loss_by_round"]
    assert set(curves) == {"fp32", "fp32_sgd", "topk"} and all(len(losses) == 2 for losses in curves.values())
    assert result["fp32_reference"] in ("fp32", "fp32_sgd")
    assert result["final_eval_loss"]["fp32"] < result["final_eval_loss"]["topk"]  # 2 rounds of 2% cannot catch up
    assert len(result["topk_rounds_behind"]) == 2
    assert (tmp_path / "sparse_horizon-smoke.png").read_bytes()[:4] == b"\x89PNG"
    # A sweep of topk alone reuses the fp32 curves of that run, and says so; another horizon is refused.
    swept = _run("sparse_horizon.py", tmp_path, "--rounds", "2", "--systems", "topk", "--topk-outer-lr", "1.1")
    assert swept.returncode == 0, swept.stdout[-3000:] + swept.stderr[-3000:]
    again = json.loads((tmp_path / "sparse_horizon-smoke.json").read_text())
    assert again["reused_from_previous_run"] == ["fp32", "fp32_sgd"] and again["outer"]["topk"]["lr"] == 1.1
    assert again["eval_loss_by_round"]["fp32"] == curves["fp32"]
    assert again["eval_loss_by_round"]["topk"] != curves["topk"]
    refused = _run("sparse_horizon.py", tmp_path, "--rounds", "3", "--systems", "topk")
    assert refused.returncode != 0 and "no 3-round curve of fp32" in refused.stderr, refused.stderr[-2000:]


def test_utilization_benchmark_smoke(tmp_path: Path) -> None:
    completed = _run("utilization.py", tmp_path)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    result = json.loads((tmp_path / "utilization-smoke.json").read_text())
    assert result["link"] in ("netns", "limiter")
    fractions = result["compute_fraction"]
    assert set(fractions) == {"blocking", "streaming"}
    assert all(0 < value <= 1 for value in fractions.values()), fractions
    streaming = next(row for row in result["rows"] if row["mode"] == "streaming")
    assert all(count > 0 for count in streaming["merged_rounds"].values()), streaming
    assert not list(Path("/var/run/netns").glob("p2pdu-*")), "the benchmark left network namespaces behind"


def test_compute_fraction_excludes_evaluation() -> None:
    records = [
        {"time": 10.0, "round_s": 4.0, "compute_s": 2.0, "eval_s": 1.0},
        {"time": 14.0, "round_s": 4.0, "compute_s": 2.0, "eval_s": 1.0},
    ]
    assert compute_fraction(records) == 4.0 / (8.0 - 2.0)


def test_bandwidth_keeps_the_wider_model_out_of_the_codec_means() -> None:
    from bandwidth import FIGURES, summarise

    def row(codec: str, tcp: float, wide: bool = False) -> dict:
        figures = dict.fromkeys(FIGURES, 1.0) | {"tcp_over_payload_steady": tcp, "final_eval_loss": 2.0}
        extra = {"parameters": 4 if wide else 1, "payload_bytes_per_round": 10.0}
        return {"codec": codec, "H": 100, "seed": 0, "wide": wide, "chatter_by_round": [], **figures, **extra}

    result = summarise([row("fp32", 1.1), row("topk", 2.0), row("topk", 1.3, wide=True)], {100: 2})
    assert result["tcp_over_payload_steady"] == {"fp32": 1.1, "topk": 2.0}
    assert result["tcp_over_payload_steady_wide"]["topk"]["tcp_over_payload_steady"] == 1.3
    assert result["tcp_over_payload_steady_wide"]["topk"]["parameters"] == 4


def test_a_plain_bandwidth_run_carries_the_extended_rows_over_with_their_dates() -> None:
    from bandwidth import carry_over

    def row(codec: str, h: int, seed: int = 0) -> dict:
        return {"codec": codec, "H": h, "seed": seed, "wide": False}

    earlier = {
        "date": "2026-12-05T09:44:52",
        "carried_over": {"fp16@H100": "2026-12-03T10:00:00"},
        "rows": [row("fp16", 100), row("bf16", 100), row("fp32", 50), row("fp32", 100), row("int2", 100, 1)],
    }
    rows, when = carry_over([row("fp32", 100), row("topk", 100)], earlier)
    # Only extended rows come over (the old fp32 and int2 rows of the plain grid do not), each with its own date.
    assert sorted((r["codec"], r["H"]) for r in rows) == [
        ("bf16", 100),
        ("fp16", 100),
        ("fp32", 50),
        ("fp32", 100),
        ("topk", 100),
    ]
    assert when == {
        "fp16@H100": "2026-12-03T10:00:00",
        "bf16@H100": "2026-12-05T09:44:52",
        "fp32@H50": "2026-12-05T09:44:52",
    }
    assert carry_over([row("fp16", 100)], {"rows": [row("fp16", 100)]}) == ([row("fp16", 100)], {})
