"""Per-outer-step metrics of an island as JSON lines: one self-contained record per line."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

REQUIRED_KEYS = (
    "peer_id",  # this island's hivemind peer id, as a string
    "run_id",  # name shared by every island of one run
    "outer_step",  # outer step this record closes
    "inner_steps_total",  # inner steps this island has done since it started, cumulative
    "loss",  # mean training loss over the inner steps of this outer step
    "eval_loss",  # loss on the shared held-out text, or None when not evaluated this step
    "tokens",  # tokens this island has trained on, cumulative
    "partners",  # how many other islands were averaged with in this outer step
    "wait_s",  # seconds spent waiting on the swarm (matchmaking + all-reduce) in this outer step
    "bytes_sent",  # bytes sent for averaging in this outer step
    "bytes_recv",  # bytes received for averaging in this outer step
    "time",  # Unix time the record was made
)


def _json_safe(value: Any) -> Any:
    """Replaces NaN/inf floats with None, recursively, and unwraps numpy/torch scalars."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    item = getattr(value, "item", None)
    if callable(item):
        # numpy and torch 0-d values: their float may be NaN too, so sanitize what comes out.
        return _json_safe(item())
    raise TypeError(f"metrics value {value!r} of type {type(value).__name__} is not JSON-serializable")


class MetricsWriter:
    """Appends one JSON object per line to a file (creating parent folders); each line written with a single
    write() + flush() + os.fsync so a crash never leaves a half line that readers choke on."""

    def __init__(self, path: str | os.PathLike | None, trackers: list | None = None) -> None:
        """Opens nothing yet; None disables the file so callers need no if around write(). `trackers` (TensorBoard,
        W&B: `p2p_diloco.train.trackers`) get every record too."""
        self.path = Path(path) if path is not None else None
        self.trackers = list(trackers or [])
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _drop_partial_last_line(self.path)

    @property
    def enabled(self) -> bool:
        """Whether write() actually writes."""
        return self.path is not None

    def write(self, record: dict) -> None:
        """Validates the record and appends it as one JSON line, durably (and hands it to the trackers)."""
        if self.path is None and not self.trackers:
            return
        missing = [key for key in REQUIRED_KEYS if key not in record]
        if missing:
            raise ValueError(f"metrics record is missing required keys: {', '.join(missing)}")
        safe = _json_safe(record)
        for tracker in self.trackers:
            tracker.log(safe)
        if self.path is None:
            return
        line = json.dumps(safe, allow_nan=False, separators=(",", ":")) + "\n"
        data = line.encode("utf-8")
        # O_APPEND + one os.write per line: concurrent readers see whole lines or nothing of it.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Close the trackers (the JSONL file is never held open)."""
        for tracker in self.trackers:
            tracker.close()


def _drop_partial_last_line(path: Path) -> None:
    """Repairs a crash's unterminated last line so the next append does not glue onto it."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return
    if size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        # Scan back in blocks for the last newline; a half line is short so this reads little.
        pos = size
        keep = 0
        while pos > 0:
            start = max(0, pos - 65536)
            f.seek(start)
            block = f.read(pos - start)
            idx = block.rfind(b"\n")
            if idx >= 0:
                keep = start + idx + 1
                break
            pos = start
        f.seek(keep)
        tail = f.read()
        try:
            json.loads(tail)
        except (json.JSONDecodeError, UnicodeDecodeError):
            f.truncate(keep)
        else:
            # A whole record that only lost its newline is kept, not thrown away.
            f.seek(0, os.SEEK_END)
            f.write(b"\n")
        f.flush()
        os.fsync(f.fileno())


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Reads a JSONL metrics file, skipping a truncated last line if any."""
    path = Path(path)
    lines = path.read_bytes().split(b"\n")
    records: list[dict] = []
    last = len(lines) - 1
    for lineno, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            # Only the last line may be half-written (a crash mid-write); damage elsewhere is real corruption.
            if lineno == last:
                break
            raise ValueError(f"{path}:{lineno + 1}: not a JSON object ({e})") from e
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{lineno + 1}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records
