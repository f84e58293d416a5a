"""Decoupled merging under heterogeneity: 4 islands, one 3x slower, the same wall-clock budget per configuration.

Compares synchronous DiLoCo (everyone waits for everyone), quorum K=1 without grace, and K=1 with the
adaptive grace window, with plain-mean, token-weighted and RDA merges (and Delayed Nesterov). Reports each
island's final eval loss, goodput (training tokens per second summed over islands) and the fraction of
wall-clock time the fast islands spent blocked on the network.

    python benchmarks/decoupled.py            # full run, 45 s per configuration (about 7 minutes on 2 cores)
    python benchmarks/decoupled.py --quick    # every configuration, short budget
    python benchmarks/decoupled.py --smoke    # two configurations on the tiny model (used by the tests)
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from common import machine, run_islands

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"

# (name, mode, merge, flags)
CONFIGS = [
    ("sync", "synchronous", "tokens", ["--quorum", "4", "--averaging-timeout", "120"]),
    ("k1-nograce-mean", "k1_no_grace", "mean", ["--grace", "fixed", "--grace-s", "0"]),
    ("k1-nograce-tokens", "k1_no_grace", "tokens", ["--grace", "fixed", "--grace-s", "0"]),
    ("k1-adaptive-mean", "k1_adaptive", "mean", ["--grace", "adaptive"]),
    ("k1-adaptive-tokens", "k1_adaptive", "tokens", ["--grace", "adaptive"]),
    ("k1-adaptive-rda", "k1_adaptive", "rda", ["--grace", "adaptive"]),
    (
        "k1-adaptive-tokens-delayed",
        "k1_adaptive_delayed_nesterov",
        "tokens",
        ["--grace", "adaptive", "--momentum-every", "2"],
    ),
]
SMOKE = ["sync", "k1-adaptive-tokens"]


def run_config(
    name: str,
    merge: str,
    flags: list[str],
    *,
    budget: float,
    islands: int,
    slow: float,
    inner_steps: int,
    tiny: bool,
    out: Path,
) -> dict:
    """One configuration: bootstrap + islands for `budget` seconds; returns its row."""
    flags = [
        "--num-shards",
        str(islands),
        "--outer-steps",
        "100000",
        "--time-budget-s",
        str(budget),
        "--inner-steps",
        str(inner_steps),
        "--target-group-size",
        str(islands),
        "--merge",
        merge,
        "--min-matchmaking-time",
        "0.5",
        "--request-timeout",
        "0.4",
        "--eval-batches",
        "8",
        *flags,
    ]
    if tiny:
        flags += ["--config", str(REPO / "peers" / "tiny.toml")]

    def island_flags(index: int) -> list[str]:
        slower = ["--slowdown", str(slow)] if index == islands - 1 and slow > 1 else []
        return ["--shard-index", str(index), *slower]

    records, exit_codes, wall = run_islands(
        out / name, name, islands, flags, per_island=island_flags, timeout=budget + 300
    )
    fast = [f"island-{i}" for i in range(islands - 1)] if slow > 1 else list(records)
    tokens = sum(recs[-1]["tokens"] for recs in records.values() if recs)
    busy = {island: sum(r["round_s"] for r in recs) for island, recs in records.items()}
    blocked = [sum(r["wait_s"] for r in records[island]) / max(busy[island], 1e-9) for island in fast]
    final = {island: (recs[-1]["eval_loss"] if recs else None) for island, recs in records.items()}
    losses = [loss for loss in final.values() if loss is not None]
    return {
        "name": name,
        "final_eval_loss": final,
        "mean_final_eval_loss": sum(losses) / len(losses) if losses else None,
        "goodput": tokens / budget,
        "blocked_fraction": sum(blocked) / len(blocked),
        "outer_steps": {island: (recs[-1]["outer_step"] if recs else 0) for island, recs in records.items()},
        "mean_partners": {
            island: (sum(r["partners"] for r in recs) / len(recs) if recs else 0.0) for island, recs in records.items()
        },
        "mean_grace_s": sum(r["grace_s"] or 0 for recs in records.values() for r in recs)
        / max(1, sum(len(recs) for recs in records.values())),
        "exit_codes": exit_codes,
        "wall_s": wall,
    }


def plot(rows: list[dict], path: Path) -> None:
    """Bar charts: mean final eval loss, goodput and blocked fraction per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [row["name"] for row in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for axis, key, label in zip(
        axes,
        ("mean_final_eval_loss", "goodput", "blocked_fraction"),
        (
            "mean final eval loss (lower is better)",
            "goodput, tokens/s (higher is better)",
            "fast islands' blocked fraction",
        ),
    ):
        axis.bar(range(len(rows)), [row[key] or 0 for row in rows], color="tab:blue")
        axis.set_xticks(range(len(rows)), names, rotation=35, ha="right", fontsize=8)
        axis.set_title(label, fontsize=10)
        axis.grid(axis="y", alpha=0.3)
    losses = [row["mean_final_eval_loss"] for row in rows if row["mean_final_eval_loss"]]
    if losses:
        axes[0].set_ylim(min(losses) * 0.97, max(losses) * 1.02)
    fig.suptitle("Decoupled merging: 4 islands, one 3x slower, equal wall-clock budget")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    """Run the configurations and write benchmarks/results/decoupled.json and decoupled.png."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short budget per configuration")
    parser.add_argument("--smoke", action="store_true", help="two configurations, tiny model, seconds each")
    parser.add_argument("--budget", type=float, help="seconds per configuration")
    parser.add_argument("--out", default=str(RESULTS), help="folder for the JSON, the PNG and run logs")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = [c for c in CONFIGS if c[0] in SMOKE] if args.smoke else CONFIGS
    budget = args.budget or (12 if args.smoke else 30 if args.quick else 45)
    inner_steps = 10 if args.smoke else 20
    rows = []
    for name, mode, merge, flags in configs:
        print(f"== {name}: {budget:.0f}s ...", flush=True)
        row = run_config(
            name,
            merge,
            flags,
            budget=budget,
            islands=4,
            slow=3.0,
            inner_steps=inner_steps,
            tiny=args.smoke,
            out=out / "decoupled-runs",
        )
        row.update({"mode": mode, "merge": merge})
        rows.append(row)
        print(
            f"   eval {row['mean_final_eval_loss']:.4f}  goodput {row['goodput']:.0f} tok/s  "
            f"blocked {row['blocked_fraction']:.3f}  steps {row['outer_steps']}",
            flush=True,
        )
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "budget_s": budget,
        "islands": 4,
        "slowdown_of_last_island": 3.0,
        "rows": rows,
    }
    by_name = {row["name"]: row for row in rows}
    if {"k1-adaptive-tokens", "k1-nograce-tokens", "sync"} <= set(by_name):
        adaptive, nograce, sync = by_name["k1-adaptive-tokens"], by_name["k1-nograce-tokens"], by_name["sync"]
        result["targets"] = {
            "adaptive_goodput_vs_k1_no_grace": adaptive["goodput"] / nograce["goodput"],
            "adaptive_eval_minus_sync_eval": adaptive["mean_final_eval_loss"] - sync["mean_final_eval_loss"],
        }
    name = "decoupled-smoke" if args.smoke else "decoupled"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    plot(rows, out / f"{name}.png")
    print(f"wrote {out / (name + '.json')} and {out / (name + '.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
