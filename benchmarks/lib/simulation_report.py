"""The goodput simulator's output: tables, the comparison with the paper, the sensitivity rows, notes, the plot."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from lib.simulation import Params, simulate_data_parallel
from lib.simulation_p2p import simulate_p2p

PAPER = {
    "source": "Decoupled DiLoCo for Resilient Distributed Pre-training (arXiv 2604.21428), goodput table",
    "setting": "one interruption per chip-year, simulated chips",
    "chips": 1_200_000,
    "goodput": {"p2p_diloco": 0.88, "data_parallel": 0.27},
    "labels": {"p2p_diloco": "Decoupled DiLoCo", "data_parallel": "data-parallel"},
}


def column(row: dict) -> str:
    if row["method"] == "data_parallel":
        return "DP"
    if row["method"] == "elastic_data_parallel":
        return "elastic"
    return f"p2p M={row['islands']}"


def chips_label(chips: int) -> str:
    return f"{chips / 1e6:g}M" if chips >= 1_000_000 else f"{chips / 1e3:g}k"


def table(rows: list[dict], key: str = "goodput") -> str:
    """Rows = chip counts, columns = methods (p2p-diloco per island count), `key` in percent."""
    rows = [row for row in rows if key in row]
    columns = list(dict.fromkeys(column(row) for row in rows))
    chips_list = list(dict.fromkeys(row["chips"] for row in rows))
    cells = {(row["chips"], column(row)): row[key] for row in rows}
    lines = ["chips    " + "".join(f"{name:>11}" for name in columns)]
    for chips in chips_list:
        values = "".join(f"{100 * cells[(chips, name)]:>10.1f}%" for name in columns)
        lines.append(f"{chips_label(chips):<9}{values}")
    return "\n".join(lines)


def compare_with_paper(rows: list[dict]) -> dict:
    """The simulated rows at the paper's chip count, next to its figures."""
    chips = PAPER["chips"]
    at = [row for row in rows if row["chips"] == chips]
    if not at:
        return {"chips": chips, "note": "the paper's chip count was not simulated in this run"}
    dp = next(row for row in at if row["method"] == "data_parallel")
    elastic = next(row for row in at if row["method"] == "elastic_data_parallel")
    p2p = {str(row["islands"]): row for row in at if row["method"] == "p2p_diloco"}
    return {
        "chips": chips,
        "paper": PAPER["goodput"],
        "simulated": {
            "data_parallel": dp["goodput"],
            "data_parallel_analytic": dp["analytic_goodput"],
            "elastic_data_parallel": elastic["goodput"],
            "p2p_diloco": {m: row["goodput"] for m, row in p2p.items()},
            "p2p_diloco_undiscounted": {m: row["goodput_undiscounted"] for m, row in p2p.items()},
        },
        "difference_vs_paper": {
            "data_parallel": dp["goodput"] - PAPER["goodput"]["data_parallel"],
            "p2p_diloco": {m: row["goodput"] - PAPER["goodput"]["p2p_diloco"] for m, row in p2p.items()},
        },
    }


SENSITIVITY = (
    ("defaults", {}),
    ("recovery=checkpoint", {"recovery": "checkpoint"}),
    ("discount=1 (stale tokens in full)", {"discount": 1.0}),
    ("restart_s=30", {"restart_s": 30.0}),
    ("restart_s=120", {"restart_s": 120.0}),
    ("island restart 30 s, job restart 60 s", {"island_restart_s": 30.0}),
    ("ckpt_interval_s=0 (nothing lost)", {"ckpt_interval_s": 0.0}),
    ("H=50", {"inner_steps": 50}),
    ("bandwidth 5 Gbit/s", {"bandwidth_gbps": 5.0}),
)


def sensitivity(islands_list, p: Params, seed: int = 0) -> list[dict]:
    """At the paper's chip count: data-parallel and p2p-diloco at the two largest island counts, one input changed."""
    chips = PAPER["chips"]
    counts = sorted(set(islands_list))[-2:]
    out = []
    for change, fields in SENSITIVITY:
        variant = replace(p, **fields)
        entry = {"change": change, "data_parallel": simulate_data_parallel(chips, variant, seed)["goodput"]}
        for islands in counts:
            row = simulate_p2p(chips, islands, variant, seed)
            entry[f"p2p_diloco_M{islands}"] = row["goodput"]
            entry[f"p2p_diloco_M{islands}_undiscounted"] = row["goodput_undiscounted"]
        out.append(entry)
    return out


def sensitivity_table(entries: list[dict]) -> str:
    keys = [key for key in entries[0] if key != "change"]
    lines = [
        f"{'at 1.2M chips':<40}"
        + "".join(f"{key.replace('p2p_diloco_', 'p2p ').replace('_undiscounted', ' undisc.'):>17}" for key in keys)
    ]
    for entry in entries:
        lines.append(f"{entry['change']:<40}" + "".join(f"{100 * entry[key]:>16.1f}%" for key in keys))
    return "\n".join(lines)


def _model_notes(p: Params) -> list[str]:
    """The modelling assumptions, with the values of this run."""
    rate_note = (
        f"Failures are Poisson per failure domain at {p.failures_per_chip_year:g} per chip-year: at 1.2M chips "
        f"the data-parallel job is interrupted every {1 / (1.2e6 * p.chip_rate):.0f} s on average."
        if p.chip_rate > 0
        else "Failure rate 0: every method has goodput 1."
    )
    return [
        "Virtual clock (heapq event queue), no processes. " + rate_note,
        "Goodput = useful tokens / tokens of a failure-free run of the same chips over the same wall-clock time.",
        f"data_parallel: every failure stops all chips for restart_s = {p.restart_s:g} s and rolls back to a "
        f"checkpoint taken every {p.ckpt_interval_s:g} s (in memory, free); failures during a restart are absorbed "
        "(optimistic: otherwise restarts longer than the mean time between failures would rarely finish). "
        "analytic_goodput is the renewal-theory value of the same model and checks the event loop.",
        f"elastic_data_parallel: slices of {p.slice_chips} chips; a failure pauses every chip for reconfig_s = "
        f"{p.reconfig_s:g} s (a failure during a pause extends it) and loses the in-flight step ({p.step_s:g} s); "
        "the slice returns after restart_s without a pause. Unpaused time is ~exp(-N lambda reconfig_s), so it "
        "falls quickly past ~1M chips.",
        f"p2p_diloco: M islands of N/M chips, an outer step every H = {p.inner_steps} steps ({p.round_s:g} s), "
        f"quorum K = 1. Merge weights are p2p_diloco.diloco.merge.contribution_weight('{p.merge}', c_tokens, c_steps) "
        f"times StalenessRule(max_staleness={p.max_staleness}, discount={p.discount:g}).factor(staleness); the "
        "merged step length (merged_inner_steps) comes from p2p_diloco.diloco.merge.weighted_mean. goodput counts each "
        "accepted contribution's tokens times its staleness factor; goodput_undiscounted counts them in full.",
        f"p2p_diloco recovery = '{p.recovery}': a failed island is down {p.island_restart:g} s while the "
        "others keep stepping; "
        + (
            "it then sends the pseudo-gradient of its in-memory checkpoint (merged next, discounted by staleness or "
            f"rejected) and pulls the swarm's state from a healthy peer ({p.pull_s:g} s for {p.state_bytes:.3g} "
            f"bytes at {p.bandwidth_gbps:g} Gbit/s)."
            if p.recovery == "pull"
            else "it then resumes its own checkpoint on its old anchor (its next contribution is stale) and pulls "
            f"the swarm's state ({p.pull_s:g} s) only when the rule would reject that contribution."
        ),
        f"Outer sync: 2 (M-1)/M * {p.model_bytes:.3g} bytes at {p.bandwidth_gbps:g} Gbit/s, hidden behind "
        f"tau = {p.overlap_steps} inner steps ({p.overlap_steps * p.step_s:g} s) when it fits, else the island "
        "stalls for the excess (with the defaults it fits for every M).",
        "M = 1 p2p-diloco is DiLoCo on one island: one failure domain and no peer to pull from, so it restarts "
        "from its own checkpoint exactly like data-parallel (no staleness: no other island advances the clock).",
        "Not modelled: stragglers and unequal step times (so the grace window never matters), checkpoint and "
        "outer-optimizer costs, failures of links, correlated failures, restart-time variance.",
        "Calibration: restart_s = 60 s and ckpt_interval_s = 5 s were chosen so that data-parallel lands near the "
        "paper's 27% at 1.2M chips. Our notes on the paper give neither its restart model, its checkpoint policy, "
        "its goodput definition nor the learner count behind 88%, so only the regime is matched.",
    ]


def _paper_notes(rows: list[dict]) -> list[str]:
    """The simulated figures at the paper's chip count, and why they differ from the paper's."""
    out: list[str] = []
    chips = PAPER["chips"]
    dp = next((r for r in rows if r["chips"] == chips and r["method"] == "data_parallel"), None)
    p2p = sorted((r for r in rows if r["chips"] == chips and r["method"] == "p2p_diloco"), key=lambda r: r["islands"])
    if dp and p2p:
        best = p2p[-1]
        out.append(
            f"At 1.2M chips: data-parallel {100 * dp['goodput']:.1f}% (paper 27%); p2p-diloco "
            + ", ".join(f"M={r['islands']} {100 * r['goodput']:.1f}%" for r in p2p)
            + f" (paper 88%); M={best['islands']} with stale tokens undiscounted "
            f"{100 * best['goodput_undiscounted']:.1f}%."
        )
        out.append(
            "Why p2p-diloco differs from 88%: (1) the island count matters most: an island of N/M chips is down a "
            "fraction ~ (N/M) lambda (restart_s + pull) of the time, so at 1.2M chips only M >= 16 reaches the "
            "80s; (2) goodput here charges stale pseudo-gradients by the staleness rule (tokens x discount**s), "
            "whereas a compute-time goodput (goodput_undiscounted) does not; (3) by default an island restart "
            "costs the same restart_s as a whole data-parallel restart, plus a state pull, while the paper's "
            "learners may restart faster than a 1.2M-chip job (see the island_restart_s sensitivity row); "
            "(4) the paper's own failure and recovery simulator is not reproduced, only its setting (chip counts, "
            "one interruption per chip-year)."
        )
        out.append(
            "Why data-parallel differs from 27%: restart_s was calibrated to it; the residual comes from the "
            "checkpoint grid (on average a little under ckpt_interval_s / 2 lost per failure) and from sampling noise."
        )
    return out


def _sensitivity_notes(variants: list[dict]) -> list[str]:
    """What the sensitivity rows say, in one sentence."""
    out: list[str] = []
    by = {v["change"]: v for v in variants}
    keys = [k for k in variants[0] if k.startswith("p2p_diloco_M") and not k.endswith("undiscounted")]
    if keys and "restart_s=30" in by:
        key = keys[-1]
        out.append(
            f"Sensitivity at 1.2M chips ({key}): restart_s 30 s gives {100 * by['restart_s=30'][key]:.1f}% "
            f"(data-parallel {100 * by['restart_s=30']['data_parallel']:.1f}%), 120 s gives "
            f"{100 * by['restart_s=120'][key]:.1f}% "
            f"(data-parallel {100 * by['restart_s=120']['data_parallel']:.1f}%)"
            f"; no staleness discount {100 * by['discount=1 (stale tokens in full)'][key]:.1f}%; "
            f"recovery=checkpoint {100 * by['recovery=checkpoint'][key]:.1f}%; a 5 Gbit/s link "
            f"{100 * by['bandwidth 5 Gbit/s'][key]:.1f}% (the sync no longer hides behind tau steps); islands "
            f"restarting in 30 s while the data-parallel job still takes 60 s: "
            f"{100 * by['island restart 30 s, job restart 60 s'][key]:.1f}% vs "
            f"{100 * by['island restart 30 s, job restart 60 s']['data_parallel']:.1f}%, close to the paper's "
            "pair (88%, 27%): a failure domain of 75k chips can plausibly restart faster than a 1.2M-chip job."
        )
    return out


def notes(rows: list[dict], p: Params, variants: list[dict] | None = None) -> list[str]:
    """The modelling assumptions and why the numbers differ from the paper's."""
    return _model_notes(p) + _paper_notes(rows) + (_sensitivity_notes(variants) if variants else [])


def _plot_series(ax, rows: list[dict], cmap) -> None:
    """One line per method / island count; dotted: p2p-diloco with stale tokens undiscounted."""
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        series.setdefault(column(row), []).append((row["chips"], row["goodput"]))
    styles = {"DP": ("black", "o", "-"), "elastic": ("tab:gray", "s", "--")}
    p2p_names = [name for name in series if name.startswith("p2p")]
    for index, name in enumerate(p2p_names):
        styles[name] = (cmap(index / max(1, len(p2p_names) - 1) * 0.9), "^", "-")
    for name, points in series.items():
        color, marker, line = styles[name]
        xs, ys = zip(*sorted(points))
        label = {"DP": "data-parallel", "elastic": "elastic data-parallel"}.get(name, f"p2p-diloco, {name[4:]}")
        ax.plot(xs, [100 * y for y in ys], marker=marker, linestyle=line, color=color, label=label)
        if name.startswith("p2p"):
            full = sorted((row["chips"], row["goodput_undiscounted"]) for row in rows if column(row) == name)
            ax.plot(
                [x for x, _ in full],
                [100 * y for _, y in full],
                linestyle=":",
                color=color,
                alpha=0.6,
                label="p2p-diloco, stale tokens undiscounted" if name == p2p_names[-1] else None,
            )


def _mark_paper(ax) -> None:
    """The paper's two figures at its chip count."""
    chips = PAPER["chips"]
    ax.scatter(
        [chips],
        [100 * PAPER["goodput"]["p2p_diloco"]],
        marker="*",
        s=260,
        color="tab:red",
        zorder=5,
        label="paper: Decoupled DiLoCo 88%",
    )
    ax.scatter(
        [chips],
        [100 * PAPER["goodput"]["data_parallel"]],
        marker="X",
        s=160,
        color="tab:red",
        zorder=5,
        label="paper: data-parallel 27%",
    )


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Goodput vs chips (log x), one line per method / island count, the paper's figures marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    _plot_series(ax, rows, plt.get_cmap("viridis"))
    _mark_paper(ax)
    ax.set_xscale("log")
    all_chips = sorted({row["chips"] for row in rows})
    ax.set_xticks(all_chips)
    ax.set_xticklabels([chips_label(c) for c in all_chips])
    ax.minorticks_off()
    ax.set_ylim(0, 102)
    ax.set_xlabel("chips (one interruption per chip-year)")
    ax.set_ylabel("goodput (%)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
