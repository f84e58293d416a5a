"""The quality benchmark's references and baseline carried over from the last result, dated; `--extended`
(make bench-all) reruns them.

- The isolated islands (island 0 of them is the single island) train alone, with no exchange at all: carried over
  from the last result of the same settings. They took 160 of quality.py's 1230 s on 2026-12-05.
- Data-parallel, the baseline, runs none of p2p-diloco's swarm: a seed's run is carried over only while every
  repository file its ranks imported, and torch's version, are byte-identical to the run's (`source_digest`), like
  a build cache. It took 495 of quality.py's 1123 s (3 seeds) on 2026-12-05. Its ranks run lib/dp_rank.py, which
  imports training code only, so an edit to the benchmark's reporting keeps the baseline.
"""

from __future__ import annotations

import json
from pathlib import Path

from lib.source_digest import source_digest

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


def _previous_run(previous: Path, settings: dict, keys: tuple[str, ...], seed: int) -> tuple[dict, dict] | None:
    """The last result and its run of `seed` when it ran with the same `keys` of `settings`; None otherwise."""
    if not previous.exists():
        return None
    old = json.loads(previous.read_text())
    if any(old.get("settings", {}).get(key) != settings[key] for key in keys):
        return None
    run = next((run for run in old.get("runs_by_seed", []) if run.get("seed") == seed), {})
    return old, run


def carried_references(previous: Path, settings: dict) -> dict | None:
    """The references of the first seed from `previous` when it ran them on that seed alone with the same
    settings: {"seed", "date", "initial_eval_loss", "rows", "curves"}; None otherwise."""
    seed = settings["seeds"][0]
    found = _previous_run(previous, settings, SAME_SETTINGS, seed)
    if found is None:
        return None
    old, run = found
    if any(old.get("seeds_by_system", {}).get(name) != [seed] for name in REFERENCES):
        return None  # a mean over several seeds is no one seed's curve
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


def carried_baseline(previous: Path, settings: dict, seed: int) -> dict | None:
    """Data-parallel's run of `seed` from `previous` when the settings are the same and its sources unchanged:
    {"date", "initial_eval_loss", "row", "curve"}; None otherwise."""
    found = _previous_run(previous, settings, BASELINE_SETTINGS, seed)
    if found is None:
        return None
    old, run = found
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
