"""The quality benchmark's smoke mode runs end to end, so the benchmark cannot silently rot."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from benchmarks_path import BENCHMARKS

SYSTEMS = {"data_parallel", "p2p_diloco", "isolated", "single"}
MARK = "P2P_DILOCO_QUALITY_TEST"


def marked_processes(value: str) -> list[psutil.Process]:
    """Live processes that inherited MARK=value: the benchmark and everything it started."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(MARK) == value and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def test_quality_smoke(tmp_path: Path) -> None:
    mark = uuid.uuid4().hex
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "quality.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, MARK: mark},
    )
    assert result.returncode == 0, result.stderr[-4000:] + "\n--- stdout:\n" + result.stdout[-2000:]
    # No process the benchmark started (ranks, peers, bootstrap, hivemind's DHT and p2pd) outlives it
    deadline = time.monotonic() + 15
    while (left := marked_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes outlived the benchmark: {[(p.pid, p.name()) for p in left]}"

    data = json.loads((tmp_path / "quality-smoke.json").read_text())
    assert set(data["final_eval_loss"]) == SYSTEMS
    assert all(math.isfinite(loss) and loss > 0 for loss in data["final_eval_loss"].values())
    assert math.isfinite(data["p2p_vs_dp_ratio"])
    assert {"command", "date", "machine", "settings", "curves"} <= set(data)
    assert data["seeds"] == [0]
    assert data["final_eval_loss_by_seed"]["p2p_diloco"] == [data["final_eval_loss"]["p2p_diloco"]]
    assert set(data["curves"]) == SYSTEMS
    steps, every = data["settings"]["outer_steps"], data["settings"]["eval_every"]
    evaluated = [step for step in range(1, steps + 1) if step % every == 0 or step == steps]
    assert every > 1 and len(evaluated) < steps  # the smoke run skips an evaluation, as the full run does
    for curve in data["curves"].values():
        # the initial point and one per evaluated outer step: every system evaluates at the same steps
        assert len(curve["tokens"]) == len(curve["eval_loss"]) == len(evaluated) + 1
        assert all(math.isfinite(loss) for loss in curve["eval_loss"])
    four_workers = [data["curves"][name]["tokens"] for name in ("data_parallel", "p2p_diloco", "isolated")]
    assert four_workers[0] == four_workers[1] == four_workers[2]
    # Same total tokens for the three 4-worker systems; the single island sees a quarter of them
    totals = {name: curve["tokens"][-1] for name, curve in data["curves"].items()}
    assert totals["data_parallel"] == totals["p2p_diloco"] == totals["isolated"] == 4 * totals["single"]
    # Every p2p round averaged all four islands, and the data-parallel replicas stayed identical
    assert data["systems"]["p2p_diloco"]["rounds_with_all_islands"] == 1.0
    # ... so every island held the same anchor, and island 0's eval speaks for all four
    assert data["systems"]["p2p_diloco"]["anchor_digests_agree"] is True
    assert data["systems"]["data_parallel"]["replica_max_abs_diff"] == 0.0
    # What a later plain run needs to carry data-parallel over: this seed's curve and what its ranks imported
    baseline = data["runs_by_seed"][0]["systems"]["data_parallel"]
    assert baseline["curve"]["eval_loss"] == data["curves"]["data_parallel"]["eval_loss"]
    assert len(baseline["source_digest"]) == 64
    sources = set(baseline["sources"])
    assert {"p2p_diloco/train/model.py", "p2p_diloco/diloco/inner.py", "benchmarks/lib/dp_rank.py"} <= sources
    # ... and not the benchmark's reporting, whose edits must not void a carried-over baseline
    assert not sources & {"benchmarks/quality.py", "benchmarks/lib/quality_report.py", "benchmarks/lib/common.py"}
    assert (tmp_path / "quality-smoke.png").read_bytes()[:4] == b"\x89PNG"


def test_seeds_combine_into_means_with_their_spread() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    from lib.quality_seeds import combine_seeds

    finals = [
        {"data_parallel": 2.0, "p2p_diloco": 2.2, "isolated": 3.0, "single": 3.5},
        {"data_parallel": 1.0, "p2p_diloco": 1.2, "isolated": 2.0, "single": 2.5},
    ]
    curve = lambda losses: {"tokens": [0, 10], "eval_loss": losses, "inner_steps_per_worker": [0, 5]}  # noqa: E731
    curves = [{name: curve([5.0, final[name]]) for name in final} for final in finals]
    combined = combine_seeds([7, 8], finals, curves)
    assert combined["seeds"] == [7, 8]
    assert combined["final_eval_loss"]["p2p_diloco"] == pytest.approx(1.7)
    assert combined["p2p_vs_dp_ratio"] == pytest.approx(1.7 / 1.5)  # the ratio of the means, not the mean of the ratios
    assert combined["p2p_vs_dp_ratio_by_seed"] == pytest.approx([1.1, 1.2])
    spread = combined["final_eval_loss_spread"]["data_parallel"]
    assert spread == {"min": 1.0, "max": 2.0, "std": pytest.approx(2**-0.5)}
    assert combined["curves"]["single"]["eval_loss"] == [5.0, 3.0]
    assert combined["curves"]["single"]["eval_loss_max_over_seeds"] == [5.0, 3.5]


def test_a_plain_quality_run_carries_the_references_of_one_seed_over_only_from_the_same_settings(
    tmp_path: Path,
) -> None:
    from lib.quality_carry import carried_references

    settings = {"outer_steps": 288, "inner_steps": 5, "eval_batches": 8, "eval_every": 8, "island_lr": 2.5e-3}
    settings.update(outer_lr=1.0, outer_momentum=0.0, config=None, seeds=[0, 1, 2])
    curve = {"tokens": [0, 10], "eval_loss": [5.0, 2.0], "inner_steps_per_worker": [0, 5]}
    old = {
        "date": "2026-12-05T03:50:12",
        "settings": {**settings, "islands": 4},
        "seeds_by_system": {"isolated": [0], "single": [0], "p2p_diloco": [0, 1, 2]},
        "runs_by_seed": [
            {"seed": 0, "initial_eval_loss": 5.0, "systems": {"isolated": {"final_eval_loss": 2.0}, "single": {}}}
        ],
        "curves": {"isolated": {**curve, "eval_loss_min_over_seeds": [5.0, 2.0]}, "single": curve},
    }
    previous = tmp_path / "quality.json"
    previous.write_text(json.dumps(old))
    carried = carried_references(previous, settings)
    assert carried["seed"] == 0 and carried["date"] == "2026-12-05T03:50:12" and carried["initial_eval_loss"] == 5.0
    assert carried["rows"]["isolated"] == {"final_eval_loss": 2.0}
    assert carried["curves"]["isolated"] == curve, "only one seed's curve keys, not the band over seeds"
    # Carried twice, the references keep the date they were measured on.
    previous.write_text(json.dumps({**old, "date": "2026-12-06", "carried_over": {"isolated": "2026-12-05T03:50:12"}}))
    assert carried_references(previous, settings)["date"] == "2026-12-05T03:50:12"
    # Another horizon, or references that were a mean over several seeds: nothing to carry.
    assert carried_references(previous, {**settings, "outer_steps": 144}) is None
    previous.write_text(json.dumps({**old, "seeds_by_system": {"isolated": [0, 1], "single": [0, 1]}}))
    assert carried_references(previous, settings) is None
    assert carried_references(tmp_path / "missing.json", settings) is None


def test_data_parallel_is_carried_over_only_while_every_source_its_ranks_imported_is_unchanged(
    tmp_path: Path,
) -> None:
    from lib.quality_carry import carried_baseline
    from lib.source_digest import source_digest

    settings = {"outer_steps": 288, "inner_steps": 5, "eval_batches": 8, "eval_every": 8, "island_lr": 2.5e-3}
    settings.update(dp_lr=2.5e-3, outer_lr=1.0, outer_momentum=0.0, config=None, seeds=[0, 1, 2])
    sources = ["p2p_diloco/train/model.py", "benchmarks/lib/quality_dp.py"]
    curve = {"tokens": [0, 10], "eval_loss": [5.0, 2.0], "inner_steps_per_worker": [0, 5]}
    row = {"final_eval_loss": 2.0, "date": "2026-12-05T03:50:12", "curve": curve, "sources": sources}
    row["source_digest"] = source_digest(sources)
    runs = [{"seed": seed, "initial_eval_loss": 5.0 + seed, "systems": {"data_parallel": row}} for seed in (0, 1)]
    previous = tmp_path / "quality.json"

    def carried(seed: int = 1, **changed) -> dict | None:
        data = {"date": "2026-12-06", "settings": settings, "runs_by_seed": runs}
        previous.write_text(json.dumps({**data, **changed}))
        return carried_baseline(previous, settings, seed)

    baseline = carried()
    assert baseline["initial_eval_loss"] == 6.0 and baseline["curve"] == curve
    assert baseline["date"] == "2026-12-05T03:50:12" and "curve" not in baseline["row"]
    assert carried(seed=2) is None  # not run on that seed
    assert carried(settings={**settings, "dp_lr": 3e-3}) is None
    tampered = [{**run, "systems": {"data_parallel": {**row, "source_digest": "0" * 64}}} for run in runs]
    assert carried(runs_by_seed=tampered) is None, "a source edited since the run: rerun it"
    gone = [{**run, "systems": {"data_parallel": {**row, "sources": [*sources, "p2p_diloco/gone.py"]}}} for run in runs]
    assert carried(runs_by_seed=gone) is None
    assert carried_baseline(tmp_path / "missing.json", settings, 0) is None
