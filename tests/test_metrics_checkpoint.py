"""Metrics JSONL, atomic checkpoints and the demo report: fast, CPU only."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from p2p_diloco.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    sidecar_path,
)
from p2p_diloco.train.metrics import REQUIRED_KEYS, MetricsWriter, read_metrics
from p2p_diloco.train.summary import format_summary, plot_losses, summarize


def make_record(step: int, **overrides: object) -> dict:
    """A complete metrics record for an outer step."""
    record = {
        "peer_id": "QmPeer",
        "run_id": "run",
        "outer_step": step,
        "inner_steps_total": (step + 1) * 10,
        "loss": 5.0 - step,
        "eval_loss": 5.5 - step,
        "tokens": (step + 1) * 640,
        "partners": 1,
        "wait_s": 0.5,
        "bytes_sent": 100,
        "bytes_recv": 100,
        "time": 1_700_000_000.0 + step,
    }
    record.update(overrides)
    return record


# ---------------------------------------------------------------- metrics


def test_writer_refuses_record_missing_keys(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path / "m.jsonl")
    record = make_record(0)
    del record["loss"], record["wait_s"]
    with pytest.raises(ValueError, match="loss") as info:
        writer.write(record)
    assert "wait_s" in str(info.value)
    assert not (tmp_path / "m.jsonl").exists() or read_metrics(tmp_path / "m.jsonl") == []


def test_writer_creates_parents_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "m.jsonl"
    writer = MetricsWriter(path)
    for step in range(3):
        writer.write(make_record(step))
    records = read_metrics(path)
    assert [r["outer_step"] for r in records] == [0, 1, 2]
    assert set(REQUIRED_KEYS) <= set(records[0])
    assert path.read_text().count("\n") == 3


def test_disabled_writer_is_noop(tmp_path: Path) -> None:
    writer = MetricsWriter(None)
    assert not writer.enabled
    writer.write({"anything": 1})  # not validated, not written
    assert list(tmp_path.iterdir()) == []


def test_nan_and_inf_become_null(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    MetricsWriter(path).write(make_record(0, loss=float("nan"), eval_loss=float("inf"), extra=[float("-inf"), 1.5]))
    raw = path.read_text()
    assert "NaN" not in raw and "Infinity" not in raw
    json.loads(raw)  # strict JSON
    (record,) = read_metrics(path)
    assert record["loss"] is None and record["eval_loss"] is None
    assert record["extra"] == [None, 1.5]


def test_tensor_scalars_are_unwrapped(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    MetricsWriter(path).write(make_record(0, loss=torch.tensor(2.5), eval_loss=torch.tensor(float("nan"))))
    (record,) = read_metrics(path)
    assert record["loss"] == 2.5 and record["eval_loss"] is None


def test_read_skips_truncated_last_line(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(path)
    writer.write(make_record(0))
    writer.write(make_record(1))
    with open(path, "a") as f:
        f.write(json.dumps(make_record(2))[:25])  # a crash mid-write
    assert [r["outer_step"] for r in read_metrics(path)] == [0, 1]


def test_read_rejects_corruption_in_the_middle(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(make_record(0)) + "\n{garbage\n" + json.dumps(make_record(1)) + "\n")
    with pytest.raises(ValueError, match=":2:"):
        read_metrics(path)


def test_new_writer_repairs_half_line_before_appending(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    MetricsWriter(path).write(make_record(0))
    with open(path, "a") as f:
        f.write('{"peer_id": "Qm')  # the previous process died here
    MetricsWriter(path).write(make_record(1))  # restarted process
    assert [r["outer_step"] for r in read_metrics(path)] == [0, 1]


def test_new_writer_keeps_whole_record_missing_only_newline(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(make_record(0)))
    MetricsWriter(path).write(make_record(1))
    assert [r["outer_step"] for r in read_metrics(path)] == [0, 1]


# ---------------------------------------------------------------- checkpoints


def make_state(step: int) -> dict:
    """An outer state like an island's: tensors, nested dicts, lists, scalars, strings."""
    torch.manual_seed(step)
    return {
        "step": step,
        "params": {"w": torch.randn(4, 3), "b": torch.zeros(3)},
        "momentum": [torch.randn(4, 3), torch.randn(3)],
        "lr": 0.7,
        "run_id": "run",
    }


def test_save_load_round_trip(tmp_path: Path) -> None:
    state = make_state(3)
    path = save_checkpoint(tmp_path / "ckpt", state, step=3)
    assert path.name == "ckpt-00000003.pt"
    assert sidecar_path(path).is_file()
    loaded = load_checkpoint(path)
    assert loaded["step"] == 3 and loaded["lr"] == 0.7 and loaded["run_id"] == "run"
    assert torch.equal(loaded["params"]["w"], state["params"]["w"])
    assert torch.equal(loaded["params"]["b"], state["params"]["b"])
    assert all(torch.equal(a, b) for a, b in zip(loaded["momentum"], state["momentum"], strict=True))
    assert latest_checkpoint(tmp_path / "ckpt") == path


def test_only_keep_newest_remain(tmp_path: Path) -> None:
    for step in range(5):
        save_checkpoint(tmp_path, make_state(step), step=step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-00000003.pt",
        "ckpt-00000003.pt.sha256",
        "ckpt-00000004.pt",
        "ckpt-00000004.pt.sha256",
    ]


def test_latest_checkpoint_empty_or_missing_dir(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "nope") is None


def test_latest_ignores_temp_file_and_pt_without_sidecar(tmp_path: Path) -> None:
    good = save_checkpoint(tmp_path, make_state(1), step=1)
    # A crash during the temp write, and one between the checkpoint and its sidecar.
    (tmp_path / ".ckpt-abc.tmp").write_bytes(b"partial")
    (tmp_path / "ckpt-00000009.pt.tmp").write_bytes(b"partial")
    torch.save(make_state(2), tmp_path / "ckpt-00000002.pt")
    assert latest_checkpoint(tmp_path) == good


def test_corrupt_newest_falls_back_to_older(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    older = save_checkpoint(tmp_path, make_state(1), step=1)
    newest = save_checkpoint(tmp_path, make_state(2), step=2)
    data = bytearray(newest.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 8] = bytes(b ^ 0xFF for b in data[mid : mid + 8])
    newest.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="p2p_diloco.train.checkpoint"):
        assert latest_checkpoint(tmp_path) == older
    assert any("corrupt" in r.getMessage() and newest.name in r.getMessage() for r in caplog.records)
    with pytest.raises(CheckpointError, match="sha256"):
        load_checkpoint(newest)
    assert load_checkpoint(older)["step"] == 1


@pytest.mark.parametrize("with_sidecar", [True, False])
def test_load_truncated_raises_checkpoint_error_with_path(tmp_path: Path, with_sidecar: bool) -> None:
    path = save_checkpoint(tmp_path, make_state(1), step=1)
    if not with_sidecar:
        sidecar_path(path).unlink()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert str(path) in message and "corrupt" in message and "--checkpoint-dir" in message
    assert "\n" not in message


def test_resave_same_step_replaces_cleanly(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, make_state(1), step=1)
    path = save_checkpoint(tmp_path, make_state(99), step=1)
    assert latest_checkpoint(tmp_path) == path
    assert load_checkpoint(path)["step"] == 99


def test_save_cleans_leftover_temp_files(tmp_path: Path) -> None:
    (tmp_path / ".ckpt-old.tmp").write_bytes(b"x" * 100)
    save_checkpoint(tmp_path, make_state(1), step=1)
    assert not list(tmp_path.glob("*.tmp"))


# ---------------------------------------------------------------- report


def two_islands() -> dict[str, list[dict]]:
    """Island a: 3 steps, eval missing in the first; island b: 2 steps, a NaN loss read back as None."""
    a = [
        make_record(0, loss=4.0, eval_loss=None, partners=0, wait_s=1.0, tokens=640),
        make_record(1, loss=3.0, eval_loss=3.5, partners=1, wait_s=2.0, tokens=1280),
        make_record(2, loss=2.0, eval_loss=2.5, partners=2, wait_s=3.0, tokens=1920),
    ]
    b = [
        make_record(0, peer_id="QmB", loss=None, eval_loss=4.2, partners=1, wait_s=0.5, tokens=640),
        make_record(1, peer_id="QmB", loss=2.8, eval_loss=3.1, partners=1, wait_s=1.5, tokens=1280),
    ]
    return {"a": a, "b": b}


def test_summarize_first_last_mean() -> None:
    sa, sb = summarize(two_islands())
    assert (sa.name, sa.peer_id, sa.outer_steps) == ("a", "QmPeer", 3)
    assert (sa.first_loss, sa.last_loss) == (4.0, 2.0)
    assert (sa.first_eval_loss, sa.last_eval_loss) == (3.5, 2.5)
    assert math.isclose(sa.mean_partners, 1.0) and math.isclose(sa.mean_wait_s, 2.0)
    assert sa.tokens == 1920
    assert (sb.name, sb.peer_id, sb.outer_steps) == ("b", "QmB", 2)
    assert (sb.first_loss, sb.last_loss) == (2.8, 2.8)
    assert (sb.first_eval_loss, sb.last_eval_loss) == (4.2, 3.1)
    assert math.isclose(sb.mean_partners, 1.0) and math.isclose(sb.mean_wait_s, 1.0)


def test_summarize_empty_island() -> None:
    (s,) = summarize({"idle": []})
    assert s.outer_steps == 0 and s.first_loss is None and s.mean_wait_s == 0.0 and s.tokens == 0


def test_format_summary_table() -> None:
    text = format_summary(summarize(two_islands()))
    lines = text.splitlines()
    assert len(lines) == 4  # header, separator, two islands
    assert lines[0].split("  ")[0].strip() == "island"
    for column in ("outer steps", "first loss", "last loss", "first eval", "last eval", "mean partners"):
        assert column in lines[0]
    assert "mean wait s" in lines[0]
    assert lines[2].split() == ["a", "3", "4.0000", "2.0000", "3.5000", "2.5000", "1.00", "2.00"]
    assert lines[3].split() == ["b", "2", "2.8000", "2.8000", "4.2000", "3.1000", "1.00", "1.00"]
    # Aligned: every column ends at the same offset in every line.
    assert len({len(line) for line in lines}) == 1


def test_plot_losses_writes_png(tmp_path: Path) -> None:
    out = plot_losses(two_islands(), tmp_path / "plots" / "loss.png", title="test run")
    assert out == tmp_path / "plots" / "loss.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 1000


def test_a_process_knows_its_age_to_a_clock_tick() -> None:
    # A restart's start-up phases are measured from the process's creation (chaos.py's breakdown): psutil's
    # create_time was up to a second off, enough to make the phases add up to more than the whole restart.
    import subprocess
    import sys
    import time

    code = "from p2p_diloco.island.progress import process_age_s; print(process_age_s())"
    launched = time.time()
    printed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    elapsed = time.time() - launched
    assert 0 < float(printed) <= elapsed + 0.02, (printed, elapsed)
