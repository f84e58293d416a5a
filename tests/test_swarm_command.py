"""The `p2p-diloco swarm` demo command: progress, summary, plot, and a clean stop on Ctrl-C."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import psutil
from conftest import TINY, wait_until

from p2p_diloco.train.metrics import read_metrics


def swarm_command(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "p2p_diloco", "swarm", "--config", str(TINY), "--out", str(out), *args]


def test_swarm_command_runs_and_summarises(tmp_path: Path) -> None:
    result = subprocess.run(
        swarm_command(tmp_path, "--peers", "2", "--outer-steps", "3", "--baseline"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[island-0] outer step 1/3" in result.stdout, "no progress shown"
    assert "first eval" in result.stdout and "island-1" in result.stdout, "no summary table"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [island["name"] for island in summary["islands"]] == ["island-0", "island-1", "alone"]
    for name in ("island-0", "island-1", "alone"):  # a late starter may adopt the swarm's step and skip ahead
        assert read_metrics(tmp_path / f"{name}.jsonl")[-1]["outer_step"] == 3
    assert summary["islands"][0]["mean_partners"] > 0 and summary["islands"][2]["mean_partners"] == 0
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ctrl_c_stops_every_island(tmp_path: Path) -> None:
    process = subprocess.Popen(
        swarm_command(tmp_path, "--peers", "2", "--outer-steps", "200"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until(
            lambda: (tmp_path / "island-1.jsonl").exists() and read_metrics(tmp_path / "island-1.jsonl"),
            180,
            "the swarm to start training",
        )
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=90)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "interrupted" in output
    survivors = [p.pid for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert not survivors, f"islands still running after Ctrl-C: {survivors}"
