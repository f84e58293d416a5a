"""Goodput at scale: a discrete-event simulation of data-parallel, elastic data-parallel and p2p-diloco.

No processes and no training: a virtual clock (a heapq event queue) drives failures, restarts, outer-step
boundaries and state pulls for one training job of `chips` chips, split into M islands for p2p-diloco. It is
the setting of the Decoupled DiLoCo paper's goodput table (arXiv 2604.21428: 88% for Decoupled DiLoCo vs 27%
for data-parallel at 1.2M chips, one interruption per chip-year), with every input a command-line flag.

    python benchmarks/simulator.py            # 150k..2.4M chips, M = 1, 2, 4, 8, 16, 14 virtual days
    python benchmarks/simulator.py --quick    # 3 chip counts, M = 1, 4, 16, 1 virtual day (a few seconds)

Writes benchmarks/results/simulator.json and simulator.png (runs/bench-quick/simulator-quick.* with --quick): the
rows, the paper's figures, the comparison at 1.2M chips, a one-input-at-a-time sensitivity table and notes.

Model (all assumptions; see also "notes" in the JSON):

* Failures. Every chip is interrupted as a Poisson process of rate lambda = failures_per_chip_year / (365.25
  days). Failures are sampled per failure domain, never per chip: the whole data-parallel job (rate N*lambda),
  the elastic job (rate N*lambda, the failed slice drawn uniformly), or a p2p island of C = N/M chips (rate
  C*lambda). A failure that hits a unit which is already down (restarting, reconfiguring, pulling
  state) is absorbed by the recovery in progress: the spare is swapped in as part of it. This is optimistic for
  data-parallel, whose restarts are long compared to its time between failures at 1M+ chips.
* Goodput = useful training tokens / the tokens a failure-free run of the same chips does in the same wall-clock
  time (N * T / step_s, per-chip batch fixed). Every method has goodput 1 without failures (given that the
  p2p-diloco sync fits in its overlap window).
* data_parallel: one synchronous job. Any chip failure stops every chip; the job restarts in `restart_s` and
  resumes from its last checkpoint, taken every `ckpt_interval_s` of training (in memory / on peers, free), so
  the work since that checkpoint is lost. A renewal-theory formula for this case is in `analytic_data_parallel`.
* elastic_data_parallel: the job is made of slices of `slice_chips` chips. A failure removes its slice: every chip
  stalls `reconfig_s` while the mesh is rebuilt, the in-flight step is lost, and the job continues at reduced
  throughput while the slice restarts (`restart_s`); the slice rejoins at a step boundary without a global pause
  (optimistic). No rollback to a checkpoint.
* p2p_diloco with M islands of N/M chips: each island is an independent learner stepping every `step_s`. Outer
  steps happen on a global grid every H * step_s + sync stall (healthy islands have the same step time, so they arrive
  together, within the grace window, which is therefore not modelled further). Quorum K = 1: a merge happens
  when at least one island contributes; nobody waits for a dead island. Each contribution carries c_steps inner
  steps and c_tokens = c_steps * C tokens since the island last contributed; its merge weight is the real
  `p2p_diloco.diloco.merge.contribution_weight(rule, c_tokens, c_steps)` times the real
  `p2p_diloco.diloco.staleness.StalenessRule.factor(staleness)`, so a recovering island with fewer steps or an older
  anchor counts less; the merged step length (reported as `merged_inner_steps`) is computed with the real
  `weighted_mean`. Useful progress counts each accepted contribution's tokens times its staleness factor (a
  stale pseudo-gradient discounted by 0.5 is worth half its tokens); `goodput_undiscounted` counts accepted
  tokens in full, which is closer to a compute-time goodput.
  A failure stalls only its island, for `restart_s` (or `island_restart_s`); it keeps what its last in-memory
  checkpoint holds (the same `ckpt_interval_s` as data-parallel; the grid restarts at each outer step). The
  staleness of a contribution is the number of merges the swarm did since the anchor it was computed from.
  `--recovery pull` (default; Decoupled DiLoCo: "a restarted learner pulls a checkpoint from a healthy peer"):
  the restarted island sends the pseudo-gradient of its checkpoint, merged at the next outer step with its
  staleness (discounted, or rejected by the rule), and pulls the swarm's current state from a healthy peer
  (state_bytes / bandwidth), then trains from that fresh anchor. `--recovery checkpoint`: it resumes training
  from its own checkpoint on its old anchor, so everything it sends at the next outer step is stale; it pulls
  only when the rule would reject that contribution. With no healthy peer (M = 1) it always resumes its own
  checkpoint. Failures while pulling are absorbed like failures while restarting.
  Outer syncs send the pseudo-gradient (model_bytes) in a butterfly all-reduce, 2 (M-1)/M * model_bytes /
  bandwidth seconds, overlapped with the next `overlap_steps` (tau) inner steps: hidden if it fits, otherwise
  the island stalls for the excess after every outer step.
  M = 1 is DiLoCo on one island: one failure domain, so it fails, restarts and rolls back like data-parallel
  (no other island advances the clock while it is down, so its contributions are never stale).
* Restart, reconfiguration and pull times are deterministic; step times are equal on every island (no
  stragglers); checkpoints, inner-island communication and the outer optimizer cost nothing.

Defaults are chosen so that data-parallel lands in the paper's regime at 1.2M chips (restart_s = 60 s with a
5 s in-memory checkpoint gives ~27%); they are a calibration, not a reproduction of the paper's simulator.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, fields

from lib.common import benchmark_parser, provenance, write_result
from lib.simulation import METHODS, RECOVERY, Params, simulate_data_parallel, simulate_elastic
from lib.simulation_p2p import simulate_p2p
from lib.simulation_paper import paper_comparison
from lib.simulation_report import PAPER, compare_with_paper, notes, plot, sensitivity, sensitivity_table, table

from p2p_diloco.diloco.merge import MERGE_RULES

FULL_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
FULL_ISLANDS = (1, 2, 4, 8, 16)
QUICK_CHIPS = (150_000, 1_200_000, 2_400_000)
QUICK_ISLANDS = (1, 4, 16)


def simulate(method: str, chips: int, islands: int, p: Params, seed: int = 0) -> dict:
    """One row of the table."""
    if method == "data_parallel":
        return simulate_data_parallel(chips, p, seed)
    if method == "elastic_data_parallel":
        return simulate_elastic(chips, p, seed)
    if method == "p2p_diloco":
        return simulate_p2p(chips, islands, p, seed)
    raise ValueError(f"unknown method {method!r}; one of {METHODS}")


def run_grid(chips_list, islands_list, p: Params, seed: int = 0) -> list[dict]:
    """Every method at every chip count; p2p-diloco at every island count."""
    rows = []
    for chips in chips_list:
        rows.append(simulate("data_parallel", chips, 1, p, seed))
        rows.append(simulate("elastic_data_parallel", chips, 1, p, seed))
        for islands in islands_list:
            rows.append(simulate("p2p_diloco", chips, islands, p, seed))
    return rows


def parse_count(text: str) -> int:
    """'150k', '1.2M', '2400000' -> an int."""
    text = text.strip()
    scale = {"k": 1e3, "K": 1e3, "m": 1e6, "M": 1e6}.get(text[-1:], 1.0)
    if scale != 1.0:
        text = text[:-1]
    return int(round(float(text) * scale))


def parse_list(text: str) -> list[int]:
    return [parse_count(item) for item in text.split(",") if item.strip()]


def build_parser() -> argparse.ArgumentParser:
    """Every input of the simulation as a flag, plus the grid, --quick and --out."""
    d = Params()
    parser = benchmark_parser(
        __doc__,
        quick="3 chip counts, M = 1, 4, 16, 1 virtual day",
        smoke=None,
        out="folder for simulator.json and simulator.png",
    )
    parser.add_argument("--chips", type=parse_list, help="chip counts, e.g. 150k,300k,600k,1.2M,2.4M")
    parser.add_argument("--islands", type=parse_list, help="p2p-diloco island counts, e.g. 1,2,4,8,16")
    parser.add_argument("--failures-per-chip-year", type=float, default=d.failures_per_chip_year)
    parser.add_argument("--restart-s", type=float, default=d.restart_s, help="job, slice or island restart time")
    parser.add_argument("--island-restart-s", type=float, help="p2p island restart time (default: --restart-s)")
    parser.add_argument("--reconfig-s", type=float, default=d.reconfig_s, help="elastic: global pause per failure")
    parser.add_argument("--ckpt-interval-s", type=float, default=d.ckpt_interval_s, help="0: no work lost")
    parser.add_argument("--step-s", type=float, default=d.step_s, help="inner step time (every island)")
    parser.add_argument("--inner-steps", "-H", type=int, default=d.inner_steps, help="H, steps per outer step")
    parser.add_argument("--overlap-steps", type=int, default=d.overlap_steps, help="tau, steps a sync may hide in")
    parser.add_argument("--model-bytes", type=float, default=d.model_bytes, help="pseudo-gradient payload")
    parser.add_argument("--state-bytes", type=float, default=d.state_bytes, help="state pulled from a peer")
    parser.add_argument("--bandwidth-gbps", type=float, default=d.bandwidth_gbps, help="inter-island link")
    parser.add_argument("--slice-chips", type=int, default=d.slice_chips, help="elastic: chips per slice")
    parser.add_argument("--days", type=float, help=f"virtual duration (default {d.days:g}, quick 1)")
    parser.add_argument("--merge", choices=MERGE_RULES, default=d.merge, help="merge weight rule")
    parser.add_argument("--max-staleness", type=int, default=d.max_staleness)
    parser.add_argument("--discount", type=float, default=d.discount)
    parser.add_argument(
        "--recovery",
        choices=RECOVERY,
        default=d.recovery,
        help="p2p island restart: pull the swarm's state, or resume its own checkpoint",
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser


def params_from(args: argparse.Namespace) -> Params:
    """The Params the flags ask for (every field but `days` has a flag of the same name)."""
    values = {f.name: getattr(args, f.name) for f in fields(Params) if f.name != "days"}
    return Params(**values, days=args.days if args.days is not None else (1.0 if args.quick else Params.days))


def print_results(rows: list[dict], comparison: dict, variants: list[dict]) -> None:
    """The goodput tables, the comparison with the paper and the sensitivity table."""
    print(table(rows))
    print("\np2p-diloco, stale tokens counted in full (goodput_undiscounted):")
    print(table(rows, "goodput_undiscounted"))
    if "simulated" in comparison:
        sim = comparison["simulated"]
        p2p = ", ".join(f"M={m} {100 * g:.1f}%" for m, g in sim["p2p_diloco"].items())
        print("\npaper at 1.2M chips: Decoupled DiLoCo 88%, data-parallel 27%")
        print(
            f"simulated:           data-parallel {100 * sim['data_parallel']:.1f}% "
            f"(analytic {100 * sim['data_parallel_analytic']:.1f}%), p2p-diloco {p2p}"
        )
    print("\nsensitivity (one input changed at a time):")
    print(sensitivity_table(variants))


def main(argv: list | None = None) -> int:
    """Simulate the grid, print the table, write simulator.json / .png (simulator-quick.* with --quick)."""
    argv = [str(arg) for arg in argv] if argv is not None else sys.argv[1:]
    args = build_parser().parse_args(argv)
    params = params_from(args)
    chips_list = args.chips or list(QUICK_CHIPS if args.quick else FULL_CHIPS)
    islands_list = args.islands or list(QUICK_ISLANDS if args.quick else FULL_ISLANDS)
    started = time.monotonic()
    rows = run_grid(chips_list, islands_list, params, args.seed)
    elapsed = time.monotonic() - started
    comparison = compare_with_paper(rows)
    variants = sensitivity(islands_list, params, args.seed)
    print_results(rows, comparison, variants)
    paper = paper_comparison(params, args.seed)
    print(f"\nthe paper's table, elastic learners (reconfig_s calibrated to {paper['reconfig_s']:.1f} s):")
    for row in paper["rows"]:
        system = f"{row['system']} M={row['islands']}" if row["system"] == "p2p_diloco" else row["system"]
        print(
            f"  {row['chips'] / 1e6:.1f}M chips {system:<22} ours {100 * row['ours']:5.1f}%  "
            f"paper {100 * row['paper']:4.0f}%  ({row['difference_points']:+.1f} points)"
        )
    name = "simulator-quick" if args.quick else "simulator"
    result = {
        **provenance("simulator.py", argv),
        "wall_s": round(elapsed, 2),
        "seed": args.seed,
        "params": {
            **asdict(params),
            "duration_s": params.duration_s,
            "round_s": params.round_s,
            "pull_s": params.pull_s,
            "chip_rate_per_s": params.chip_rate,
        },
        "chips": chips_list,
        "islands": islands_list,
        "rows": rows,
        "paper": PAPER,
        "comparison": comparison,
        "paper_comparison": paper["rows"],
        "paper_comparison_setting": {
            "learners": "elastic",
            "reconfig_s": paper["reconfig_s"],
            "calibrated_to": "elastic data-parallel 58% at 1.2M chips (restart_s to data-parallel 27%)",
            "assumptions_that_differ": paper["assumptions"],
        },
        "sensitivity_at_1_2M_chips": variants,
        "notes": notes(rows, params, variants),
    }
    path = write_result(args.out, name, result)
    title = f"Goodput at scale, {params.failures_per_chip_year:g} interruption/chip-year, {params.days:g} virtual days"
    plot(rows, args.out / f"{name}.png", title)
    print(f"\nwrote {path} and {args.out / (name + '.png')} ({elapsed:.1f}s of simulation)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
