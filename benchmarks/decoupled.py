"""Decoupled merging under heterogeneity: 4 islands, one 3x slower, the same wall-clock budget per configuration.

Compares synchronous DiLoCo (everyone waits for everyone), quorum K=1 without grace, and K=1 with the
adaptive grace window, with plain-mean, token-weighted and RDA merges (and Delayed Nesterov). Reports each
island's final eval loss, goodput (training tokens per second summed over islands) and the fraction of
wall-clock time the fast islands spent blocked on the network.

    python benchmarks/decoupled.py            # 4 configurations, 30 s each (about 3.5 minutes on 2 cores)
    python benchmarks/decoupled.py --extended # all 7 (make bench-all; about 6 minutes)
    python benchmarks/decoupled.py --quick    # synchronous and K=1 with adaptive grace, 12 s each
    python benchmarks/decoupled.py --smoke    # two configurations on the tiny model (used by the tests)
"""

from __future__ import annotations

import json
from pathlib import Path

from lib.common import TINY, benchmark_parser, provenance, run_islands, write_result

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
EXTENDED_CONFIGS = ["k1-nograce-mean", "k1-adaptive-mean", "k1-adaptive-tokens-delayed"]
"""Run only with --extended (make bench-all): the plain-mean merges and Delayed Nesterov are variants the targets do
not read; a plain run carries their rows over from the last result of the same budget, dated."""
SMOKE = ["sync", "k1-adaptive-tokens"]
QUICK = SMOKE  # the two ends, on the default model: whether K=1 with grace still beats waiting for everyone


def swarm_flags(
    merge: str, flags: list[str], *, budget: float, islands: int, inner_steps: int, tiny: bool
) -> list[str]:
    """The flags every island of one configuration gets."""
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
    return flags + ["--config", str(TINY)] if tiny else flags


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
    flags = swarm_flags(merge, flags, budget=budget, islands=islands, inner_steps=inner_steps, tiny=tiny)

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


def targets(rows: list[dict]) -> dict | None:
    """Adaptive grace against K=1 without grace (goodput) and against synchronous DiLoCo (eval loss)."""
    by_name = {row["name"]: row for row in rows}
    if not {"k1-adaptive-tokens", "k1-nograce-tokens", "sync"} <= set(by_name):
        return None
    adaptive, nograce, sync = by_name["k1-adaptive-tokens"], by_name["k1-nograce-tokens"], by_name["sync"]
    return {
        "adaptive_goodput_vs_k1_no_grace": adaptive["goodput"] / nograce["goodput"],
        "adaptive_eval_minus_sync_eval": adaptive["mean_final_eval_loss"] - sync["mean_final_eval_loss"],
    }


def carry_over(rows: list[dict], previous: Path, skipped: list[str], budget: float) -> tuple[list[dict], dict]:
    """`rows` with the `skipped` configurations' rows from the `previous` result of the same budget, in CONFIGS
    order, and {name: date} of each carried row."""
    if not skipped or not previous.exists():
        return rows, {}
    old = json.loads(previous.read_text())
    if old.get("budget_s") != budget:
        return rows, {}
    found = {row["name"]: row for row in old.get("rows", []) if row.get("name") in skipped}
    carried = {name: old.get("carried_over", {}).get(name, old.get("date")) for name in found}
    by_name = {**found, **{row["name"]: row for row in rows}}
    return [by_name[name] for name, *_ in CONFIGS if name in by_name], carried


def main(argv: list[str] | None = None) -> int:
    """Run the configurations and write benchmarks/results/decoupled.json and decoupled.png."""
    parser = benchmark_parser(
        __doc__,
        quick="synchronous and K=1 with adaptive grace, 12 s each",
        smoke="two configurations, tiny model, seconds each",
        extended="also the plain-mean merges and Delayed Nesterov (else carried over from the last result, dated)",
    )
    parser.add_argument("--budget", type=float, help="seconds per configuration")
    args = parser.parse_args(argv)
    every = [c[0] for c in CONFIGS]
    chosen = SMOKE if args.smoke else QUICK if args.quick else every
    skipped = [] if args.extended or args.smoke or args.quick else EXTENDED_CONFIGS
    chosen = [name for name in chosen if name not in skipped]
    configs = [c for c in CONFIGS if c[0] in chosen]
    budget = args.budget or (12 if args.smoke or args.quick else 30)
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
            out=args.out / "decoupled-runs",
        )
        row.update({"mode": mode, "merge": merge})
        rows.append(row)
        print(
            f"   eval {row['mean_final_eval_loss']:.4f}  goodput {row['goodput']:.0f} tok/s  "
            f"blocked {row['blocked_fraction']:.3f}  steps {row['outer_steps']}",
            flush=True,
        )
    rows, carried = carry_over(rows, args.out / "decoupled.json", skipped, budget)
    result = {
        **provenance("decoupled.py", argv),
        "budget_s": budget,
        "islands": 4,
        "slowdown_of_last_island": 3.0,
        "rows": rows,
        **({"carried_over": carried} if carried else {}),
    }
    if (found := targets(rows)) is not None:
        result["targets"] = found
    name = "decoupled-smoke" if args.smoke else "decoupled"
    path = write_result(args.out, name, result)
    plot(rows, args.out / f"{name}.png")
    print(f"wrote {path} and {args.out / (name + '.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
