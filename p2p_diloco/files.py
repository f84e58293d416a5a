"""Files written atomically: a reader (or a restart after a crash) sees the old content or the new, never a mix."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    """Make a rename in the folder durable; without it a power cut can forget the rename."""
    if os.name == "nt":  # pragma: no cover - Windows cannot open folders
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, data: bytes, *, prefix: str | None = None, suffix: str = ".tmp") -> None:
    """Write bytes so that `path` holds either its old content or all of `data`, never a mix.

    The temporary file lives beside `path` (named `prefix`...`suffix`, default `.NAME.`...`.tmp`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix or f".{path.name}.", suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def write_lines_atomically(path: str | os.PathLike, lines: list[str]) -> None:
    """Write lines to a file atomically, one per line."""
    atomic_write(path, "".join(line + "\n" for line in lines).encode())
