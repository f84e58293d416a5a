"""Atomic checkpoints of an island's outer state: a crash at any moment resumes from the last good one."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

from p2p_diloco.errors import UserError
from p2p_diloco.files import atomic_write, fsync_dir

logger = logging.getLogger(__name__)

_CKPT_RE = re.compile(r"^ckpt-(\d{8,})\.pt$")
_TMP_PREFIX = ".ckpt-"
_TMP_SUFFIX = ".tmp"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used; the message says which file and what to do."""


def checkpoint_path(directory: str | os.PathLike, step: int) -> Path:
    """Path of the checkpoint for an outer step."""
    return Path(directory) / f"ckpt-{step:08d}.pt"


def sidecar_path(path: str | os.PathLike) -> Path:
    """Path of the sha256 sidecar that vouches for a checkpoint."""
    path = Path(path)
    return path.with_name(path.name + ".sha256")


def _atomic_write(path: Path, data: bytes) -> None:
    """Write a checkpoint file atomically; its temp file matches what pruning cleans up after a crash."""
    atomic_write(path, data, prefix=_TMP_PREFIX, suffix=_TMP_SUFFIX)


def _list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint file in the folder, oldest first; temp files do not match."""
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _CKPT_RE.match(entry.name)
        if match and entry.is_file():
            found.append((int(match.group(1)), entry))
    found.sort()
    return found


def _read_sidecar(path: Path) -> str | None:
    """The hex digest a sidecar records, or None when there is no sidecar."""
    try:
        text = sidecar_path(path).read_text(encoding="ascii", errors="replace")
    except FileNotFoundError:
        return None
    # sha256sum format ("<hex>  <name>") so `sha256sum -c` works on it by hand.
    return text.split()[0].lower() if text.split() else ""


def _sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks so big checkpoints do not double memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_checkpoint(directory: str | os.PathLike, state: dict, step: int, keep: int = 2) -> Path:
    """Saves `state` atomically as directory/ckpt-{step:08d}.pt + sha256 sidecar; keeps the newest `keep`."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    path = checkpoint_path(directory, step)
    sidecar = sidecar_path(path)
    # An old sidecar would briefly vouch for (and then fail against) the new bytes; without one, the
    # half-saved checkpoint is simply ignored.
    if sidecar.exists():
        sidecar.unlink()
        fsync_dir(directory)
    _atomic_write(path, data)
    # The sidecar comes last: its presence is what marks the checkpoint complete.
    _atomic_write(sidecar, f"{hashlib.sha256(data).hexdigest()}  {path.name}\n".encode("ascii"))
    _prune(directory, keep, protect=path)
    return path


def _prune(directory: Path, keep: int, protect: Path) -> None:
    """Deletes all but the newest `keep` checkpoints (never `protect`) and temp files left by crashes."""
    checkpoints = [p for _, p in _list_checkpoints(directory) if p != protect]
    for old in checkpoints[: max(0, len(checkpoints) - (keep - 1))]:
        # Sidecar first: a crash in between leaves a .pt without sidecar, which is ignored, not trusted.
        sidecar_path(old).unlink(missing_ok=True)
        old.unlink(missing_ok=True)
    for entry in directory.iterdir():
        if entry.name.startswith(_TMP_PREFIX) and entry.name.endswith(_TMP_SUFFIX):
            entry.unlink(missing_ok=True)
    for entry in directory.glob("ckpt-*.pt.sha256"):
        if not entry.with_name(entry.name[: -len(".sha256")]).exists():
            entry.unlink(missing_ok=True)


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """Newest checkpoint whose sha256 sidecar exists and matches; warns about and skips corrupt ones."""
    for _, path in reversed(_list_checkpoints(Path(directory))):
        expected = _read_sidecar(path)
        if expected is None:
            # Crash between writing the checkpoint and its sidecar: incomplete, not corrupt.
            logger.debug("ignoring %s: no sha256 sidecar", path)
            continue
        actual = _sha256_file(path)
        if actual != expected:
            logger.warning(
                "checkpoint %s is corrupt (sha256 %s, sidecar says %s); falling back to an older one",
                path,
                actual[:12],
                expected[:12] or "nothing",
            )
            continue
        return path
    return None


def unusable_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Checkpoints in the folder that have a sidecar which does not match (the corrupt ones)."""
    corrupt = []
    for _, path in _list_checkpoints(Path(directory)):
        expected = _read_sidecar(path)
        if expected is not None and _sha256_file(path) != expected:
            corrupt.append(path)
    return corrupt


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict:
    """Loads a checkpoint (weights_only=True) after checking its sidecar; CheckpointError if corrupt."""
    path = Path(path)

    def corrupt(reason: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {path} is corrupt ({reason}): delete it or point --checkpoint-dir elsewhere"
        )

    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    expected = _read_sidecar(path)
    if expected is not None:
        actual = _sha256_file(path)
        if actual != expected:
            raise corrupt(f"sha256 {actual[:12]} does not match sidecar {expected[:12] or 'nothing'}")
    try:
        # weights_only: a checkpoint should never be able to run code when loaded.
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises many types for damaged files (zip, pickle, EOF, runtime)
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'}"
        if expected is not None:
            # The bytes are exactly what was saved, so this is not damage; say so rather than blame the disk.
            raise CheckpointError(f"checkpoint {path} cannot be loaded ({reason})") from e
        raise corrupt(reason) from e
    if not isinstance(state, dict):
        raise corrupt(f"expected a dict, found {type(state).__name__}")
    return state
