"""Quality vs data-parallel: the same model, data and total tokens trained four ways, eval loss against tokens.

    (a) data_parallel  torch.distributed (gloo), 4 processes, one per shard, gradients all-reduced every step
                       (global batch = 4 x the island batch), the islands' AdamW, warm-up and grad clip, T*H steps
    (b) isolated       4 islands (`p2p-diloco peer --solo true`) on the 4 shards that never communicate;
                       the reported loss is the mean of their final eval losses
    (c) p2p_diloco     a real local swarm: a bootstrap and 4 `p2p-diloco peer` processes, quorum 4, T outer steps
                       of H inner steps
    (d) single         one solo island on shard 0 for the same T*H steps (it sees 1/4 of the total tokens): isolated
                       island 0 itself

Every system starts from the same initial weights (model seed), island / rank i trains on shard i of 4 with the
island's batch-order seed, and every eval uses the same held-out tail of the corpus. The systems run one after
the other so that they do not compete for the CPU.

    python benchmarks/quality.py            # default model, T=288, H=5, 3 seeds; about 11 min (the isolated and
                                            # single references carried over from the last result of the same
                                            # settings, and each seed's data-parallel run while every source
                                            # file it imported is unchanged, dated: lib/quality_carry.py;
                                            # 19 min when data-parallel runs)
    python benchmarks/quality.py --extended # everything rerun (make bench-all; up to 11 min more)
    python benchmarks/quality.py --quick    # default model, T=9, H=5, 1 seed (about a minute)
    python benchmarks/quality.py --smoke    # tiny model, T=3, H=5 (used by the tests)

With several seeds (--seeds N: seeds --seed .. --seed+N-1, each changing the initial weights and the batch order)
the final losses and curves are means over seeds, with every seed's numbers and their spread beside them.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from lib.common import TINY, benchmark_parser, provenance, write_result
from lib.quality_carry import REFERENCES, carried_baseline, carried_references
from lib.quality_common import ISLANDS, SYSTEMS, initial_eval, load_island_config
from lib.quality_dp import run_data_parallel
from lib.quality_islands import run_p2p, run_solo
from lib.quality_report import plot, table
from lib.quality_seeds import combine_seeds

# mode: (outer steps T, inner steps H, eval batches, tiny model, seeds, evaluate every this many outer steps). Every
# system evaluates at the same outer steps and the last; at T=288 an evaluation every round took a third of the
# swarm's rounds (0.34 s of 1.06 s) and as much of data-parallel's rank 0. The gap to data-parallel shrinks with the
# horizon, as the DiLoCo papers find: p2p-diloco / data-parallel was 1.047 at T=72 (3 seeds, spread 1.040-1.056),
# 1.029 at T=144 (1.024-1.037) and 1.010 at T=288 (1.007-1.014), at the same inner lr (2.5e-3, tuned at T=144), so
# the full run trains T=288 (about 16 minutes on 2 cores with an evaluation every 8 rounds; 21 with one every round,
# for the same ratio: 1.0096 then, 1.0098 now).
MODES = {
    "full": (288, 5, 8, False, 3, 8),
    "quick": (9, 5, 8, False, 1, 3),
    "smoke": (3, 5, 2, True, 1, 2),
}
# At this budget (360 inner steps) outer Nesterov momentum hurts: a sweep with the single-process reference
# (tests/test_swarm.py::reference_diloco, 4 islands, same data) gave final eval loss 2.354 (H=30, lr 0.7,
# momentum 0.9), 2.446 (H=10), 2.642 (H=5); with outer lr 1.0 and no momentum 2.108 (H=30), 1.925 (H=10),
# 1.847 (H=5); H=5 with momentum 0.3: 2.163, lr 0.5 momentum 0.9: 2.497. Without momentum at H=5, T=72 (seed 0):
# outer lr 0.7 1.855, 0.85 1.828, 1.0 1.820, 1.3 2.157, 1.6 2.390. The benchmark uses the best.
OUTER_LR, OUTER_MOMENTUM = 1.0, 0.0
# Each system trains at the inner AdamW lr best for it at this budget. A sweep at seed 0 with the single-process
# references (islands: tests/test_swarm.py::reference_diloco; data-parallel: one model stepping on the mean of the
# 4 island batches' gradients) gave, final eval loss at T=72: islands 1.5e-3 1.864, 2e-3 1.820, 2.5e-3 1.833,
# 3e-3 1.847; data-parallel 1.5e-3 1.760, 2e-3 1.724, 3e-3 1.769, 5e-3 1.981. At T=144 (this budget, 720 inner
# steps) both moved up: islands 2e-3 1.605, 2.5e-3 1.579, 3e-3 1.591 (outer lr 1.15 at 2e-3: 1.610);
# data-parallel 2e-3 1.555, 2.5e-3 1.523, 3e-3 1.556. Both train at 2.5e-3. A cosine decay to 0.1x hurt both at
# T=72 (islands 1.974, data-parallel 1.849 at 3e-3): the model is far from converged.
ISLAND_LR, DP_LR = 2.5e-3, 2.5e-3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The benchmark's flags."""
    parser = benchmark_parser(
        __doc__,
        quick="default model, fewer steps (a minute or two)",
        smoke="tiny model, a few steps (used by the tests)",
        out="folder for the JSON, the PNG and run logs",
        extended="also rerun the references and data-parallel (else carried over from the last result, dated)",
    )
    parser.add_argument("--outer-steps", type=int, help="T: outer steps (data-parallel runs T*H steps)")
    parser.add_argument("--inner-steps", type=int, help="H: inner steps per outer step")
    parser.add_argument("--eval-batches", type=int, help="batches of the held-out tail per evaluation")
    parser.add_argument("--eval-every", type=int, help="evaluate every this many outer steps (and at the last)")
    parser.add_argument("--seed", type=int, default=0, help="first model-init and batch-order seed")
    parser.add_argument("--seeds", type=int, help="how many seeds (default: 3 for the full run, else 1)")
    parser.add_argument(
        "--reference-seeds",
        type=int,
        default=1,
        help="how many of the seeds also run the isolated and single references (default 1: the ratio to "
        "data-parallel is what needs every seed; the references are far apart from it)",
    )
    parser.add_argument("--island-lr", type=float, default=ISLAND_LR, help="inner AdamW lr of every island")
    parser.add_argument("--dp-lr", type=float, default=DP_LR, help="AdamW lr of the data-parallel ranks")
    parser.add_argument("--outer-lr", type=float, default=OUTER_LR, help="outer learning rate of every island")
    parser.add_argument("--outer-momentum", type=float, default=OUTER_MOMENTUM, help="outer Nesterov momentum")
    parser.add_argument("--config", help="peer TOML config (default: p2p_diloco defaults; --smoke: peers/tiny.toml)")
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> dict:
    """The run's settings: the mode's T, H and eval batches unless given, seeds, outer optimizer and config."""
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    outer_steps, inner_steps, eval_batches, tiny, seeds, eval_every = MODES[mode]
    if args.seeds is not None and args.seeds < 1:
        raise SystemExit(f"quality.py: error: --seeds must be at least 1, not {args.seeds}")
    return {
        "mode": mode,
        "outer_steps": args.outer_steps or outer_steps,
        "inner_steps": args.inner_steps or inner_steps,
        "eval_batches": args.eval_batches or eval_batches,
        "eval_every": args.eval_every or eval_every,
        "seed": args.seed,
        "seeds": list(range(args.seed, args.seed + (args.seeds or seeds))),
        "reference_seeds": max(1, args.reference_seeds),
        "island_lr": args.island_lr,
        "dp_lr": args.dp_lr,
        "outer_lr": args.outer_lr,
        "outer_momentum": args.outer_momentum,
        "config": args.config or (str(TINY) if tiny else None),
    }


def run_systems(settings: dict, runs: Path, references: bool = True, baseline: bool = True) -> dict[str, dict]:
    """The systems one after the other (so that they do not compete for the CPU), in SYSTEMS order; without
    `references`, only data-parallel and p2p-diloco (the ratio the benchmark is about); without `baseline`, no
    data-parallel."""
    systems: dict[str, dict] = {}
    if baseline:
        print("== (a) data-parallel: 4 gloo ranks ...", flush=True)
        systems["data_parallel"] = run_data_parallel(settings, runs / "data-parallel")
    print("== (c) p2p-diloco: bootstrap + 4 islands, quorum 4 ...", flush=True)
    systems["p2p_diloco"] = run_p2p(settings, runs / "p2p")
    if not references:
        return {name: systems[name] for name in SYSTEMS if name in systems}
    print("== (b) + (d) 4 isolated islands (island 0 is the single island) ...", flush=True)
    systems["isolated"], systems["single"] = run_solo(settings, runs / "solo")
    return {name: systems[name] for name in SYSTEMS if name in systems}


def curves_from(systems: dict[str, dict], start_eval: float) -> dict[str, dict]:
    """Each system's curve (taken out of its row), starting at the shared initial weights."""
    curves = {}
    for name, row in systems.items():
        curve = row.pop("curve")
        curves[name] = {
            "tokens": [0, *curve["tokens"]],
            "eval_loss": [start_eval, *curve["eval_loss"]],
            "inner_steps_per_worker": [0, *curve["inner_steps"]],
        }
        if "eval_loss_spread" in curve:
            curves[name]["eval_loss_spread_over_islands"] = [0.0, *curve["eval_loss_spread"]]
    return curves


def describe(settings: dict, config, start_eval: float) -> dict:
    """The settings every system ran with, and notes on how to read the curves."""
    batch, seq_len = config.train.batch_size, config.model.seq_len
    return {
        "settings": {
            **settings,
            "islands": ISLANDS,
            "num_shards": ISLANDS,
            "batch_size_per_worker": batch,
            "seq_len": seq_len,
            "dp_global_batch": ISLANDS * batch,
            "dp_steps": settings["outer_steps"] * settings["inner_steps"],
            "tokens_per_system": ISLANDS * settings["outer_steps"] * settings["inner_steps"] * batch * seq_len,
            "model": config.model.__dict__,
            "train": {
                key: getattr(config.train, key)
                for key in ("lr", "weight_decay", "warmup_steps", "grad_clip", "outer_lr", "outer_momentum")
            },
            "initial_eval_loss": start_eval,
        },
        "notes": {
            "tokens": "x = tokens processed by the whole system (data-parallel and p2p-diloco: summed over 4 workers)",
            "single": "the single island sees 1/4 of the total tokens of the other systems",
            "data_parallel": "gradients averaged with all_reduce every step, then clipped; AdamW and warm-up as "
            "make_inner_optimizer; rank r draws island r's batches (its shard and batch-order seed)",
        },
    }


def main(argv: list[str] | None = None) -> int:
    """Run the four systems one after the other and write quality.json and quality.png."""
    args = parse_args(argv)

    settings = settings_from(args)
    config = load_island_config(settings, 0)
    print(
        f"quality ({settings['mode']}): T={settings['outer_steps']} outer x H={settings['inner_steps']} inner steps, "
        f"{ISLANDS} islands, batch {config.train.batch_size} x {config.model.seq_len} tokens, "
        f"config {settings['config'] or 'defaults'}",
        flush=True,
    )
    started = time.monotonic()
    finals, curves, rows = [], [], []
    plain = not (args.extended or args.smoke or args.quick)
    previous = args.out / "quality.json"
    carried = carried_references(previous, settings) if plain else None
    reused, baselines = False, {}
    for number, seed in enumerate(settings["seeds"], start=1):
        print(f"== seed {seed} ({number} of {len(settings['seeds'])})", flush=True)
        seeded = {**settings, "seed": seed}
        start_eval = initial_eval(seeded)
        references = number <= settings["reference_seeds"]
        # The same initial weights and data: the eval agrees to float32 rounding (CPU kernels differ across machines).
        reuse = references and carried is not None and carried["seed"] == seed
        reuse = reuse and math.isclose(carried["initial_eval_loss"] or 0.0, start_eval, rel_tol=1e-6)
        if reuse:
            print(f"== (b) + (d) carried over from the result of {carried['date'][:10]} (--extended reruns them)")
        baseline = carried_baseline(previous, settings, seed) if plain else None
        if baseline is not None and not math.isclose(baseline["initial_eval_loss"] or 0.0, start_eval, rel_tol=1e-6):
            baseline = None
        if baseline is not None:
            print(f"== (a) data-parallel carried over from {baseline['date'][:10]}: its sources are unchanged")
        runs = args.out / "quality-runs" / f"seed-{seed}"
        systems = run_systems(seeded, runs, references and not reuse, baseline is None)
        curves.append(curves_from(systems, start_eval))
        if reuse:
            reused = True
            systems.update(carried["rows"])
            curves[-1].update(carried["curves"])
        if baseline is not None:
            baselines[seed] = baseline["date"]
            systems["data_parallel"], curves[-1]["data_parallel"] = dict(baseline["row"]), baseline["curve"]
        systems["data_parallel"]["curve"] = curves[-1]["data_parallel"]  # this seed's: the next run may carry it
        finals.append({name: row["final_eval_loss"] for name, row in systems.items()})
        rows.append({"seed": seed, "initial_eval_loss": start_eval, "systems": systems})
    combined = combine_seeds(settings["seeds"], finals, curves)
    final, ratio = combined["final_eval_loss"], combined["p2p_vs_dp_ratio"]
    result = {
        **combined,
        "targets": {
            "p2p_within_2pct_of_dp": ratio <= 1.02,
            "p2p_below_isolated": final["p2p_diloco"] < final["isolated"],
            "p2p_minus_isolated": final["p2p_diloco"] - final["isolated"],
        },
        **provenance("quality.py", argv),
        **describe(settings, config, rows[0]["initial_eval_loss"]),
        "systems": rows[0]["systems"],
        "runs_by_seed": rows,
        "wall_s": time.monotonic() - started,
    }
    carried_over = {name: carried["date"] for name in REFERENCES} if reused else {}
    if baselines:
        carried_over["data_parallel"] = min(baselines.values())
    if carried_over:
        result["carried_over"] = carried_over
    report(result, settings, args.out, "quality-smoke" if args.smoke else "quality")
    return 0 if all(math.isfinite(v) for v in final.values()) else 1


def report(result: dict, settings: dict, out: Path, name: str) -> None:
    """Write NAME.json and NAME.png into `out` and print the table."""
    final, ratio = result["final_eval_loss"], result["p2p_vs_dp_ratio"]
    path = write_result(out, name, result)
    title = (
        f"Quality vs data-parallel ({settings['mode']}): 4 workers, T={settings['outer_steps']}, "
        f"H={settings['inner_steps']}, {result['settings']['tokens_per_system']:,} tokens per system, "
        f"mean of {len(result['seeds'])} seed(s)"
    )
    plot(result, out / f"{name}.png", title)
    print()
    print(table(result))
    print(
        f"\np2p/dp final eval loss ratio {ratio:.4f} over seeds {result['seeds']} "
        f"(target <= 1.02: {'met' if ratio <= 1.02 else 'missed'}); "
        f"p2p - isolated {final['p2p_diloco'] - final['isolated']:+.4f}"
    )
    print(f"total wall time {result['wall_s']:.0f}s; wrote {path} and {out / (name + '.png')}")


if __name__ == "__main__":
    raise SystemExit(main())
