"""--eval-every: an island evaluates every N outer steps and at its last, and records None in between."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def peer(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "p2p_diloco", "peer", "--solo", "true", "--config", str(REPO / "peers/tiny.toml")]
    command += ["--metrics", str(tmp_path / "m.jsonl"), "--checkpoint-dir", str(tmp_path / "ck"), *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_an_island_evaluates_every_n_outer_steps_and_at_its_last(tmp_path: Path) -> None:
    result = peer(tmp_path, "--outer-steps", "5", "--inner-steps", "2", "--eval-every", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    evaluated = {r["outer_step"]: r["eval_loss"] is not None for r in records}
    assert evaluated == {1: False, 2: True, 3: False, 4: True, 5: True}
    assert all(r["eval_loss"] > 0 for r in records if r["eval_loss"] is not None)
    assert "outer step 3/5: loss" in result.stderr and "eval - partners" in result.stderr


def test_a_zero_eval_interval_is_refused_in_one_line(tmp_path: Path) -> None:
    result = peer(tmp_path, "--outer-steps", "1", "--eval-every", "0")
    assert result.returncode == 2
    assert "train.eval_every=0 must be >= 1" in result.stderr and len(result.stderr.strip().splitlines()) == 1
