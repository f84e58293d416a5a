"""Member processes of one averaging group (`exchange_member.py`), for the all-reduce and direct-lane tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from p2p_diloco.process import kill_process_tree

MEMBER = Path(__file__).with_name("exchange_member.py")


class Members:
    """Member processes of one averaging group."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen] = []

    def start(
        self, seed: int, size: int, group_size: int, peers: list[str], *extra: str, log: Path | None = None
    ) -> subprocess.Popen:
        """Start a member (its log into `log`, if given) and wait for its READY line."""
        process = subprocess.Popen(
            [
                sys.executable,
                str(MEMBER),
                "--seed",
                str(seed),
                "--size",
                str(size),
                "--group-size",
                str(group_size),
                "--initial-peers",
                *peers,
                *extra,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL if log is None else log.open("w"),
            text=True,
            start_new_session=True,
        )
        self.processes.append(process)
        line = process.stdout.readline()
        assert line.startswith("READY "), f"member {seed} failed to start: {line!r}"
        process.maddr = line.split()[1]
        return process

    def go(self) -> None:
        """Let every member start its averaging step."""
        for process in self.processes:
            process.stdin.write("GO\n")
            process.stdin.flush()

    @staticmethod
    def result(process: subprocess.Popen) -> dict:
        """The member's RESULT line."""
        notes = []
        for line in process.stdout:
            if line.startswith("RESULT "):
                process.wait(30)
                return {**json.loads(line[len("RESULT ") :]), "notes": notes}
            notes.append(line.strip())
        pytest.fail(f"member exited without a result (code {process.wait()})")

    def close(self) -> None:
        """Kill every member and its daemons."""
        for process in self.processes:
            kill_process_tree(process.pid)
            process.wait()
