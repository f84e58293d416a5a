"""The quality benchmark's report: eval loss against tokens, one line per system, and the final numbers."""

from __future__ import annotations

from pathlib import Path

from lib.quality_common import SYSTEMS

LABELS = {
    "data_parallel": "data-parallel (gloo, 4 ranks, 4x batch)",
    "p2p_diloco": "p2p-diloco (4 islands)",
    "isolated": "4 isolated islands (mean)",
    "single": "one island alone (1/4 of the tokens)",
}


def plot(results: dict, path: Path, title: str) -> None:
    """One axes: eval loss against the tokens each system processed, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(8, 5))
    styles = {"data_parallel": "-", "p2p_diloco": "-", "isolated": "--", "single": ":"}
    for name in SYSTEMS:
        curve = results["curves"][name]
        lines = axis.plot(
            curve["tokens"], curve["eval_loss"], styles[name], marker="o", markersize=3, label=LABELS[name]
        )
        if len(results.get("seeds", [])) > 1:  # the band: lowest to highest over seeds
            low, high = curve["eval_loss_min_over_seeds"], curve["eval_loss_max_over_seeds"]
            axis.fill_between(curve["tokens"], low, high, color=lines[0].get_color(), alpha=0.15, linewidth=0)
    curves = [results["curves"][name]["eval_loss"] for name in SYSTEMS]
    after_first = [losses[1] for losses in curves if len(losses) > 1]
    finals = list(results["final_eval_loss"].values())
    if after_first:
        axis.set_ylim(min(finals) - 0.05 * (max(after_first) - min(finals)), max(after_first) * 1.02)
    axis.set_xlabel("tokens processed by the system (summed over its workers)")
    axis.set_ylabel("eval loss (held-out tail, nats/byte)")
    axis.set_title(title, fontsize=10)
    axis.grid(alpha=0.3)
    axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(results: dict) -> str:
    """The final numbers (means over seeds, and their standard deviation) as a text table."""
    dp = results["final_eval_loss"]["data_parallel"]
    lines = [f"{'system':<16}{'final eval':>12}{'std':>8}{'vs DP':>9}{'tokens':>12}{'steps/worker':>14}{'wall s':>9}"]
    for name in SYSTEMS:
        row = results["systems"][name]
        loss = results["final_eval_loss"][name]
        std = results.get("final_eval_loss_spread", {}).get(name, {}).get("std", 0.0)
        lines.append(
            f"{name:<16}{loss:>12.4f}{std:>8.4f}{loss / dp - 1:>+9.2%}{row['total_tokens']:>12,}{row['steps']:>14}"
            f"{row['wall_s']:>9.0f}"
        )
    lines.append(f"(mean over seeds {results.get('seeds', [0])}; tokens, steps and wall time of the first seed)")
    partial = {name: seeds for name, seeds in results.get("seeds_by_system", {}).items() if seeds != results["seeds"]}
    if partial:
        lines.append("(" + "; ".join(f"{name}: seeds {seeds}" for name, seeds in partial.items()) + ")")
    return "\n".join(lines)
