"""A bootstrap keeps its peer id across restarts; an island resumes from its checkpoint after a restart."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import TINY

from p2p_diloco.cli.launcher import start_bootstrap, stop
from p2p_diloco.train.metrics import read_metrics


def _bootstrap_with_identity(folder: Path, identity: Path) -> tuple[list[str], list[str]]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "p2p_diloco",
            "bootstrap",
            "--identity",
            str(identity),
            "--maddrs-file",
            str(folder / "maddrs.txt"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        printed = []
        for line in process.stdout:
            if line.startswith("MADDR "):
                printed.append(line.split()[1])
            if line.strip().startswith("p2p-diloco peer --initial-peers"):
                assert all(maddr in line for maddr in printed)
                break
        return printed, (folder / "maddrs.txt").read_text().split()
    finally:
        stop(process)


def test_bootstrap_identity_survives_restart(tmp_path: Path) -> None:
    identity = tmp_path / "keys" / "bootstrap.key"
    first_printed, first_file = _bootstrap_with_identity(tmp_path, identity)
    assert identity.exists() and first_printed and first_printed == first_file
    second_printed, _ = _bootstrap_with_identity(tmp_path, identity)
    peer_id = first_printed[0].split("/p2p/")[1]
    assert all(maddr.endswith(f"/p2p/{peer_id}") for maddr in second_printed)


def test_island_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    def run(outer_steps: int) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "p2p_diloco",
                "peer",
                "--config",
                str(TINY),
                "--solo",
                "true",
                "--outer-steps",
                str(outer_steps),
                "--checkpoint-dir",
                str(tmp_path / "ckpt"),
                "--metrics",
                str(tmp_path / "metrics.jsonl"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )

    assert run(2).returncode == 0
    second = run(4)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "starting from checkpoint at outer step 2" in second.stderr
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["outer_step"] for r in records] == [1, 2, 3, 4]
    assert records[2]["inner_steps_total"] == 3 * 10 and records[2]["tokens"] == records[1]["tokens"] * 3 // 2


def test_bootstrap_helper_reads_maddrs(tmp_path: Path) -> None:
    process, maddrs = start_bootstrap(tmp_path)
    try:
        assert maddrs and all(maddr.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in maddr for maddr in maddrs)
        assert (tmp_path / "bootstrap.maddrs").read_text().split() == maddrs
    finally:
        stop(process)
