"""The quality benchmark over several seeds: final losses and curves as the mean over seeds, with their spread."""

from __future__ import annotations

import statistics

from lib.quality_common import SYSTEMS


def spread(values: list[float]) -> dict[str, float]:
    """Min, max and sample standard deviation (0 for one value) of one system's finals over seeds."""
    return {
        "min": min(values),
        "max": max(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
    }


def combine_seeds(seeds: list[int], finals: list[dict[str, float]], curves: list[dict[str, dict]]) -> dict:
    """Per seed's final losses and curves into the means the report shows, keeping every seed's numbers (a system
    run on only some seeds, as the references are, is the mean over the seeds it ran)."""
    by_seed = {name: [final[name] for final in finals if name in final] for name in SYSTEMS}
    ratios = [final["p2p_diloco"] / final["data_parallel"] for final in finals]
    mean = {name: statistics.fmean(values) for name, values in by_seed.items()}
    return {
        "seeds": seeds,
        "final_eval_loss": mean,
        "final_eval_loss_by_seed": by_seed,
        "final_eval_loss_spread": {name: spread(values) for name, values in by_seed.items()},
        "p2p_vs_dp_ratio": mean["p2p_diloco"] / mean["data_parallel"],
        "p2p_vs_dp_ratio_by_seed": ratios,
        "p2p_vs_dp_ratio_spread": spread(ratios),
        "seeds_by_system": {name: [s for s, final in zip(seeds, finals) if name in final] for name in SYSTEMS},
        "curves": {name: mean_curve([curve[name] for curve in curves if name in curve]) for name in SYSTEMS},
    }


def mean_curve(runs: list[dict]) -> dict:
    """One system's curve averaged over seeds (every seed evaluates at the same token counts)."""
    first = runs[0]
    points = min(len(run["eval_loss"]) for run in runs)
    losses = [[run["eval_loss"][index] for run in runs] for index in range(points)]
    curve = {
        "tokens": first["tokens"][:points],
        "eval_loss": [statistics.fmean(values) for values in losses],
        "eval_loss_min_over_seeds": [min(values) for values in losses],
        "eval_loss_max_over_seeds": [max(values) for values in losses],
        "inner_steps_per_worker": first["inner_steps_per_worker"][:points],
    }
    if "eval_loss_spread_over_islands" in first:
        curve["eval_loss_spread_over_islands"] = first["eval_loss_spread_over_islands"][:points]
    return curve
