"""`make bench`'s runner: every benchmark in turn, timed, stopping at the first failure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNNER = REPO / "scripts" / "run_benchmarks.py"


def _runner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RUNNER), *args], capture_output=True, text=True, timeout=600, cwd=REPO)


def test_the_runner_times_each_benchmark_and_writes_its_result(tmp_path: Path) -> None:
    completed = _runner("--only", "simulator", "--quick", "--out", str(tmp_path))
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
    assert "[1/1] simulator.py:" in completed.stdout and "1 benchmarks in" in completed.stdout
    assert json.loads((tmp_path / "simulator-quick.json").read_text())["paper_comparison"]
    assert not (tmp_path / "bench_times.json").exists()  # a partial run must not pass for the whole bench


def test_an_unknown_benchmark_is_named(tmp_path: Path) -> None:
    completed = _runner("--only", "nosuch", "--out", str(tmp_path))
    assert completed.returncode != 0
    assert "no benchmark named nosuch" in completed.stderr


def test_every_benchmark_script_is_run_and_the_report_is_not() -> None:
    sys.path.insert(0, str(RUNNER.parent))
    try:
        from run_benchmarks import scripts
    finally:
        sys.path.remove(str(RUNNER.parent))
    names = [path.name for path in scripts(None)]
    assert "report.py" not in names and names == sorted(names)
    assert {"quality.py", "exchange.py", "link.py", "bandwidth.py", "chaos.py", "simulator.py"} <= set(names)
    assert "attacks.py" not in names  # on request only
    everything = [path.name for path in scripts(None, everything=True)]
    assert set(everything) == set(names) | {"attacks.py", "sparse_horizon.py"}
    assert [path.name for path in scripts(["attacks"])] == ["attacks.py"]


def test_the_report_marks_partial_seeds_steady_tcp_and_scripts_not_run() -> None:
    import benchmarks_path  # noqa: F401
    import report

    quality = report.quality(
        {
            "seeds": [0, 1],
            "seeds_by_system": {"data_parallel": [0, 1], "p2p_diloco": [0, 1], "isolated": [0], "single": [0]},
            "final_eval_loss": {"data_parallel": 2.0, "p2p_diloco": 2.1, "isolated": 2.5, "single": 2.6},
        }
    )
    assert "| isolated (seeds [0]) |" in quality and "| data_parallel |" in quality
    assert "p2p-diloco / data-parallel: 1.0500" in quality
    block = {
        "ratio_vs_data_parallel": {"topk": 9000.0},
        "tcp_over_payload": {"topk": 40.0},
        "tcp_over_payload_steady": {"topk": 1.75},
        "final_eval_loss": {"topk": 3.0},
    }
    bandwidth = report.bandwidth({"H": 100, "seeds": [0], "by_H": {"100": block}})
    assert "| 100 | topk | 9000.0000 | - | 40.0000 | 1.7500 | 3.0000 |" in bandwidth


def test_the_targets_table_judges_each_figure_from_its_result_file() -> None:
    import benchmarks_path  # noqa: F401
    from lib.targets import target_rows

    exchange = {
        "rows": [
            {"system": "gloo", "codec": "fp32", "values": 10, "peers": 2, "seconds": 1.0},
            {
                "system": "p2p_diloco",
                "codec": "fp32",
                "values": 10,
                "peers": 2,
                "seconds": 2.0,
                "speedup_vs_hivemind": 3,
            },
            {
                "system": "p2p_diloco",
                "codec": "int8",
                "values": 10,
                "peers": 2,
                "seconds": 5.0,
                "speedup_vs_hivemind": 1.5,
            },
        ]
    }
    chaos = {"goodput": {"decoupled": 0.92, "standby": 0.89}}
    chaos["restart_breakdown_mean_s"] = {
        "decoupled": {"restore_s": 1, "total_s": 3},
        "standby": {"restore_s": 1, "total_s": 2},
    }
    phases = {"process_start_s": 3, "join_s": 1, "restore_s": 8, "first_round_s": 3, "total_s": 15}
    phases.update(state_bytes=76_976_128, total_over_restore=1.9, second_downloads=0)
    link_fp32_anchor_s = 3.7  # its first round's inner steps ran during the download
    link = {
        "10M int8": {**phases, "codec": "int8", "total_over_transfer_limit": 2.5, "restore_over_transfer_limit": 1.3},
        "10M fp32": {
            **phases,
            "codec": "fp32",
            "total_over_transfer_limit": 2.2,
            "restore_over_transfer_limit": 1.1,
            "anchor_s": link_fp32_anchor_s,
        },
        "38M int8": {**phases, "codec": "int8", "total_over_transfer_limit": 1.9, "restore_over_transfer_limit": 1.1},
    }
    restart_link = {"rate_mbit": 100.0, "configs": link, "restarts": [{"size": "10M", "codec": "int8"}]}
    results = {"exchange": exchange, "chaos": chaos, "restart_link": restart_link}
    rows = {row[0]: row[1:] for row in target_rows(results)}
    over_link = rows["restart to first merge / state transfer (10M int8, 100 Mbit/s)"]
    assert over_link[:3] == ["2.50x", "<= 2x", "no"] and "again, 0 of 1 (" in over_link[3]
    assert "whose 10 MB pseudo-gradient alone takes 0.8 s" in over_link[3] and "inner steps and one" in over_link[3]
    trained_early = rows["restart to first merge / state transfer (10M fp32, 100 Mbit/s)"][3]
    assert "inner steps ran during the download, from 3.7 s into it" in trained_early
    assert rows["restart to first merge / state transfer (38M int8, 100 Mbit/s)"] == ["1.90x", "<= 2x", "yes", ""]
    assert rows["exchange fp32: speed-up over stock hivemind (10M/50M x 2/4 peers)"] == ["3.00", ">= 2x", "yes", ""]
    assert rows["exchange fp32: gloo fp32's time / ours"] == ["0.50", ">= 0.25", "yes", ""]
    assert rows["exchange int8: gloo fp32's time / ours"][:3] == ["0.20", ">= 0.25", "no"]
    assert rows["exchange int8: speed-up over stock hivemind (10M/50M x 2/4 peers)"][-2] == "no"
    assert rows["goodput under chaos, decoupled"] == ["0.92", ">= 0.90", "yes", ""]
    restart = rows["restart to first merge / state transfer (chaos)"]
    assert restart[:3] == ["3.0x", "<= 2x", "no"] and "state transfer" in restart[3]  # a target missed says why
    assert "a standby (`--standby true`) takes over in 2.0 s (2.0x" in restart[3]
    assert rows["goodput under chaos, decoupled with standbys"][:3] == ["0.89", ">= 0.90", "no"]
    assert target_rows({}) == []  # no result files, no rows


def test_bench_all_passes_extended_to_every_script(monkeypatch) -> None:
    sys.path.insert(0, str(RUNNER.parent))
    try:
        import run_benchmarks
    finally:
        sys.path.remove(str(RUNNER.parent))
    commands: list[list[str]] = []
    monkeypatch.setattr(run_benchmarks.subprocess, "call", lambda command: commands.append(command) or 0)
    script = REPO / "benchmarks" / "chaos.py"
    run_benchmarks.run(script, quick=False, out=None, extended=True)
    run_benchmarks.run(script, quick=False, out=None)
    assert commands[0][-1] == "--extended" and "--extended" not in commands[1]
