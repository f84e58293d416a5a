"""The ranks benchmark runs end to end (smoke size) and writes the figures its note quotes."""

from __future__ import annotations

import json
from pathlib import Path

import benchmarks_path  # noqa: F401 - puts benchmarks/ on sys.path


def test_ranks_benchmark_smoke(tmp_path: Path) -> None:
    import ranks

    assert ranks.main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "ranks-smoke.json").read_text())
    assert set(result["tokens_per_s"]) == {label for label, _, _ in ranks.LAYOUTS}
    assert all(rate > 0 for rate in result["tokens_per_s"].values())
    assert set(result["outer_step_ms"]) == {"1 process", "2 DDP ranks", "2 FSDP ranks"}
    assert all(row["ms"] > 0 and row["params"] > 500_000 for rows in result["outer_step_ms"].values() for row in rows)
    assert (tmp_path / "ranks-smoke.png").stat().st_size > 10_000
