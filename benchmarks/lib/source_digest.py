"""What a run depends on: the project's Python files a process imported, and a digest of them and of torch's
version; lib/quality_carry.py carries a result over while its digest is unchanged, like a build cache."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCE_FOLDERS = ("p2p_diloco", "benchmarks")
"""Where the sources a result depends on live; torch's version stands for the installed packages."""


def loaded_sources() -> list[str]:
    """The project's Python files (SOURCE_FOLDERS) this process has imported, relative to the repository."""
    found = set()
    folders = [REPO / folder for folder in SOURCE_FOLDERS]
    for module in list(sys.modules.values()):
        name = getattr(module, "__file__", None)
        path = Path(name).resolve() if name and Path(name).is_absolute() else None
        if path is not None and path.suffix == ".py" and path.is_file() and any(f in path.parents for f in folders):
            found.add(str(path.relative_to(REPO)))
    return sorted(found)


def source_digest(files: list[str]) -> str | None:
    """sha256 of `files`' names and contents and of torch's version; None when a file is gone."""
    import torch

    digest = hashlib.sha256(torch.__version__.encode())
    for name in files:
        path = REPO / name
        if not path.is_file():
            return None
        digest.update(name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()
