"""The quality benchmark's references carried over: the isolated islands (island 0 of them is the single island)
train alone, with no exchange at all, so a plain run takes them from the last result of the same settings, dated;
`--extended` (make bench-all) reruns them. They took 160 of quality.py's 1230 s on 2026-12-05."""

from __future__ import annotations

import json
from pathlib import Path

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
