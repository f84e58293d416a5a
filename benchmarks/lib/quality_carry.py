"""The quality benchmark's references and baseline carried over from the last result, dated; `--extended`
(make bench-all) reruns them.

- The isolated islands (island 0 of them is the single island) train alone, with no exchange at all: carried over
  from the last result of the same settings. They took 160 of quality.py's 1230 s on 2026-12-05.
- Data-parallel, the baseline, runs none of p2p-diloco's swarm: a seed's run is carried over only while every
  repository file its ranks imported, and torch's version, are byte-identical to the run's (`source_digest`), like
  a build cache. It took 470 of quality.py's 1230 s (3 seeds).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from lib.common import REPO

REFERENCES = ("isolated", "single")
SAME_SETTINGS = (
    "outer_steps",
    "inner_steps",
    "eval_batches",
    "eval_every",
    "island_lr",
    "outer_lr",
    "outer_momentum",
    "config",
)
BASELINE_SETTINGS = (*SAME_SETTINGS, "dp_lr")
CURVE_KEYS = ("tokens", "eval_loss", "inner_steps_per_worker", "eval_loss_spread_over_islands")


def carried_references(previous: Path, settings: dict) -> dict | None:
    """The references of the first seed from `previous` when it ran them on that seed alone with the same
    settings: {"seed", "date", "initial_eval_loss", "rows", "curves"}; None otherwise."""
    if not previous.exists():
        return None
    old = json.loads(previous.read_text())
    seed, ran = settings["seeds"][0], old.get("seeds_by_system", {})
    if any(old.get("settings", {}).get(key) != settings[key] for key in SAME_SETTINGS):
        return None
    if any(ran.get(name) != [seed] for name in REFERENCES):
        return None  # a mean over several seeds is no one seed's curve
    run = next((run for run in old.get("runs_by_seed", []) if run.get("seed") == seed), {})
    if not all(name in run.get("systems", {}) for name in REFERENCES):
        return None
    return {
        "seed": seed,
        "date": old.get("carried_over", {}).get(REFERENCES[0], old.get("date")),
        "initial_eval_loss": run.get("initial_eval_loss"),
        "rows": {name: run["systems"][name] for name in REFERENCES},
        "curves": {
            name: {key: old["curves"][name][key] for key in CURVE_KEYS if key in old["curves"][name]}
            for name in REFERENCES
        },
    }


SOURCE_FOLDERS = ("p2p_diloco", "benchmarks")
"""Where the sources a baseline depends on live; torch's version stands for the installed packages."""


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


def carried_baseline(previous: Path, settings: dict, seed: int) -> dict | None:
    """Data-parallel's run of `seed` from `previous` when the settings are the same and its sources unchanged:
    {"date", "initial_eval_loss", "row", "curve"}; None otherwise."""
    if not previous.exists():
        return None
    old = json.loads(previous.read_text())
    if any(old.get("settings", {}).get(key) != settings[key] for key in BASELINE_SETTINGS):
        return None
    run = next((run for run in old.get("runs_by_seed", []) if run.get("seed") == seed), {})
    row = run.get("systems", {}).get("data_parallel") or {}
    if "curve" not in row or row.get("source_digest") is None:
        return None
    if source_digest(row.get("sources", [])) != row["source_digest"]:
        return None
    return {
        "date": row.get("date") or old.get("date"),
        "initial_eval_loss": run.get("initial_eval_loss"),
        "row": {key: value for key, value in row.items() if key != "curve"},
        "curve": row["curve"],
    }
