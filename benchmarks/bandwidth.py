"""Bytes on the wire per training token, per codec, against data-parallel; and what each codec costs in quality.

For H in {50, 100} and every codec (fp32, fp16, bf16, int8, int4, int2, topk at 2% with 2-bit values), 4 islands
train the default model for the same number of tokens, every round merging all four (quorum 4, so codecs are
compared on identical schedules); at H = 100, fp32, int2 and topk run 3 seeds (`--seeds`, `--seeded-codecs`)
and their figures are the means.
Each island counts the payload bytes its all-reduce sends and the TCP bytes its libp2p daemon sends (framing,
encryption, DHT and matchmaking included). Data-parallel with a ring all-reduce sends 2·P·4 bytes per worker
per step (P parameters, fp32), so

    ratio_vs_data_parallel = (2·P·4 / tokens per step) / (payload bytes sent per island / tokens per island)

`ratio_vs_ring_same_peers` uses the exact ring cost among the same 4 peers, 2·(M−1)/M·P·4, instead, and
`transport_ratio_vs_data_parallel` counts TCP bytes instead of payload bytes, and `tcp_over_payload` is TCP
bytes over payload bytes (framing, encryption, DHT and matchmaking chatter on top of the payload).

    python benchmarks/bandwidth.py           # H = 100 x 5 codecs (3 seeds: fp32 int2 topk), topk on a 4x wider
                                             # model (`tcp_over_payload_steady_wide`) (7 min); fp16, bf16 and
                                             # H = 50 carried over from the last --extended result, dated
    python benchmarks/bandwidth.py --extended  # and fp16, bf16, H = 50 x 3 (make bench-all; 10 min)
    python benchmarks/bandwidth.py --quick   # H = 100 only, tiny model, 1 seed, fp32 int4 topk
    python benchmarks/bandwidth.py --smoke   # fp32, int8 and topk, 2 islands, tiny model (used by the tests)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lib.common import TINY, benchmark_parser, provenance, run_islands, write_result

from p2p_diloco.config import load_config
from p2p_diloco.train.model import build_model, count_parameters

CODECS = ["fp32", "fp16", "bf16", "int8", "int4", "int2", "topk"]
SEEDED = ["fp32", "int2", "topk"]
"""Codecs run with every seed at the largest H: the sub-4-bit ones and the fp32 they are judged against (the
others, whose loss is within 1% of fp32's on one seed, run seed 0 only: 20 swarms instead of 28)."""


WIDE = ["--d-model", "256"]
"""The wider model of the `wide` rows (about 1.7M parameters, 4x the default's): chatter is a fixed cost per round,
so TCP / payload falls as the payload grows; these rows show where top-k's crosses 1.5."""
WIDE_CODECS = ("topk",)
WIDE_FIGURES = ("parameters", "tcp_over_payload_steady", "payload_bytes_per_round", "chatter_bytes_per_round")


def run_name(codec: str, inner_steps: int, seed: int, wide: bool = False) -> str:
    """The swarm's run id, also its folder under bandwidth-runs/."""
    return f"bandwidth-h{inner_steps}-{codec}" + (f"-seed{seed}" if seed else "") + ("-wide" if wide else "")


def run_one(
    codec: str,
    inner_steps: int,
    outer_steps: int,
    args: argparse.Namespace,
    out: Path,
    seed: int = 0,
    wide: bool = False,
) -> dict:
    """One swarm with one codec, H and seed (on the wider model with `wide`); returns its row."""
    name = run_name(codec, inner_steps, seed, wide)
    flags = ["--inner-steps", str(inner_steps), "--outer-steps", str(outer_steps), "--codec", codec]
    flags += WIDE if wide else []
    flags += ["--seed", str(seed)]
    flags += ["--num-shards", str(args.islands), "--quorum", str(args.islands)]
    flags += ["--target-group-size", str(args.islands), "--averaging-timeout", "120", "--batch-size", "8"]
    flags += ["--eval-batches", "16"]
    if args.tiny:
        flags += ["--config", str(TINY)]
    records, exit_codes, wall = run_islands(
        out / name,
        name,
        args.islands,
        flags,
        per_island=lambda index: ["--shard-index", str(index)],
        timeout=args.timeout,
    )
    return make_row(codec, inner_steps, outer_steps, seed, args, records, exit_codes, wall, wide)


def rescan_one(
    codec: str, inner_steps: int, outer_steps: int, args: argparse.Namespace, out: Path, seed: int, wide: bool = False
) -> dict:
    """The row of a swarm that already ran, rebuilt from its metrics files (exit codes and wall time from
    the previous result file, when it has the row)."""
    from p2p_diloco.train.metrics import read_metrics

    folder = out / run_name(codec, inner_steps, seed, wide)
    records = {path.stem: read_metrics(path) for path in sorted(folder.glob("island-*.jsonl"))}
    if not records:
        raise SystemExit(f"bandwidth.py --rescan: no metrics in {folder}; run the grid first")
    previous = next(
        (row for row in args.previous_rows if row_key(row) == (codec, inner_steps, seed, wide)),
        {},
    )
    codes, wall = previous.get("exit_codes", []), previous.get("wall_s")
    return make_row(codec, inner_steps, outer_steps, seed, args, records, codes, wall, wide)


def steady_state(recs: list[dict]) -> tuple[float, float, int]:
    """(TCP bytes, payload bytes, rounds) after an island's first round: what the join and start-up cost is left out."""
    if len(recs) < 2 or recs[0].get("transport_sent") is None or recs[-1].get("transport_sent") is None:
        return 0.0, 0.0, 0
    return recs[-1]["transport_sent"] - recs[0]["transport_sent"], sum(r["bytes_sent"] for r in recs[1:]), len(recs) - 1


def make_row(
    codec: str,
    inner_steps: int,
    outer_steps: int,
    seed: int,
    args: argparse.Namespace,
    records: dict[str, list[dict]],
    exit_codes: list,
    wall: float | None,
    wide: bool = False,
) -> dict:
    """One swarm's figures from its islands' metrics records."""
    config = load_config(TINY if args.tiny else None, {"model.d_model": 256} if wide else None)
    parameters = count_parameters(build_model(config.model, seed=0))
    tokens_per_step = 8 * config.model.seq_len
    dp_bytes_per_token = 2 * parameters * 4 / tokens_per_step
    ring_bytes_per_token = 2 * (args.islands - 1) / args.islands * parameters * 4 / tokens_per_step
    payload, transport, tokens, finals, merged_rounds = [], [], [], [], 0
    for recs in records.values():
        if not recs:
            continue
        payload.append(sum(r["bytes_sent"] for r in recs))
        transport.append(recs[-1]["transport_sent"] or 0.0)
        tokens.append(recs[-1]["tokens"])
        finals.append(recs[-1]["eval_loss"])
        merged_rounds += sum(1 for r in recs if r["merged"])
    steady = [steady_state(recs) for recs in records.values() if recs]
    by_round = [
        [round(after["wait_s"], 3), after["transport_sent"] - before["transport_sent"] - after["bytes_sent"]]
        for recs in records.values()
        for before, after in zip(recs, recs[1:])
        if after.get("transport_sent") is not None and before.get("transport_sent") is not None
    ]
    steady_tcp, steady_payload = sum(t for t, _, _ in steady), sum(p for _, p, _ in steady)
    steady_rounds = sum(n for _, _, n in steady)
    per_token = sum(payload) / max(1, sum(tokens))
    transport_per_token = sum(transport) / max(1, sum(tokens))
    row = {
        "codec": codec,
        "H": inner_steps,
        "seed": seed,
        "wide": wide,
        "outer_steps": outer_steps,
        "islands": args.islands,
        "parameters": parameters,
        "tokens_per_island": sum(tokens) / max(1, len(tokens)),
        "payload_bytes_per_token": per_token,
        "transport_bytes_per_token": transport_per_token,
        "data_parallel_bytes_per_token": dp_bytes_per_token,
        "ratio_vs_data_parallel": dp_bytes_per_token / per_token if per_token else None,
        "ratio_vs_ring_same_peers": ring_bytes_per_token / per_token if per_token else None,
        "transport_ratio_vs_data_parallel": dp_bytes_per_token / transport_per_token if transport_per_token else None,
        "tcp_over_payload": transport_per_token / per_token if per_token else None,
        "tcp_over_payload_steady": steady_tcp / steady_payload if steady_payload else None,
        "chatter_bytes_per_round": (steady_tcp - steady_payload) / steady_rounds if steady_rounds else None,
        "payload_bytes_per_round": steady_payload / steady_rounds if steady_rounds else None,
        "chatter_by_round": by_round,
        "final_eval_loss": sum(finals) / len(finals) if finals else None,
        "merged_rounds": merged_rounds,
        "exit_codes": exit_codes,
        "wall_s": wall,
    }
    print(
        f"H={inner_steps:<4} seed {seed} {codec:<5}{' wide' if wide else ''} payload {per_token:8.2f} B/token  "
        "ratio vs DP "
        f"{row['ratio_vs_data_parallel'] or 0:7.1f}x  (TCP {row['transport_ratio_vs_data_parallel'] or 0:6.1f}x)  "
        f"eval {row['final_eval_loss'] or float('nan'):.4f}  {wall:.0f}s",
        flush=True,
    )
    return row


def plot(rows: list[dict], path: Path) -> None:
    """Bandwidth ratio and final eval loss per codec, one bar group per H."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values_of_h = sorted({row["H"] for row in rows})
    codecs = [c for c in CODECS if any(row["codec"] == c for row in rows)]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(values_of_h)
    for offset, h in enumerate(values_of_h):
        by_codec = mean_rows(rows, h)
        xs = [i + offset * width for i in range(len(codecs))]
        # A codec that ran only at the other H gets no bar here.
        left.bar(xs, [by_codec.get(c, {}).get("ratio_vs_data_parallel") or 0 for c in codecs], width, label=f"H={h}")
        right.bar(xs, [by_codec.get(c, {}).get("final_eval_loss") or 0 for c in codecs], width, label=f"H={h}")
    for axis, title in ((left, "bytes per token: data-parallel / island (x)"), (right, "final eval loss")):
        axis.set_xticks([i + width * (len(values_of_h) - 1) / 2 for i in range(len(codecs))], codecs)
        axis.set_title(title)
        axis.legend()
    losses = [row["final_eval_loss"] for row in rows if row["final_eval_loss"]]
    if losses:
        right.set_ylim(min(losses) * 0.98, max(losses) * 1.01)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


FIGURES = (
    "ratio_vs_data_parallel",
    "ratio_vs_ring_same_peers",
    "transport_ratio_vs_data_parallel",
    "tcp_over_payload",
    "tcp_over_payload_steady",
    "chatter_bytes_per_round",
    "final_eval_loss",
)


def mean_rows(rows: list[dict], h: int) -> dict[str, dict]:
    """Per codec at H = h: each figure's mean over seeds, the seeds, and the final eval's spread."""
    by_codec: dict[str, list[dict]] = {}
    for row in rows:
        if row["H"] == h and not row.get("wide"):
            by_codec.setdefault(row["codec"], []).append(row)
    means = {}
    for codec, group in by_codec.items():
        mean = {}
        for figure in FIGURES:
            values = [row[figure] for row in group if row.get(figure) is not None]
            mean[figure] = sum(values) / len(values) if values else None
        losses = [row["final_eval_loss"] for row in group if row["final_eval_loss"] is not None]
        mean.update(seeds=[row["seed"] for row in group], eval_spread=max(losses) - min(losses) if losses else None)
        means[codec] = mean
    return means


def chatter_fit(rows: list[dict]) -> dict | None:
    """Least squares over every island's rounds after its first: TCP bytes beyond the payload against the seconds
    the island waited for its group (hivemind's matchmaking re-declares and polls the DHT while it waits)."""
    points = [point for row in rows for point in row.get("chatter_by_round") or []]
    if len(points) < 3:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0
    return {"fixed_bytes_per_round": mean_y - slope * mean_x, "bytes_per_second_waiting": slope, "rounds": len(points)}


SHORTER_H_CODECS = ("fp32", "int4", "topk")
"""The codecs that also run at the shorter H (the others only at the largest: there they add little)."""
EXTENDED_CODECS = ("fp16", "bf16")
EXTENDED_H = (50,)
"""Rows only --extended runs (make bench-all): the half-precision codecs' bytes are exactly half of fp32's and
their loss matched it, and H = 50 shows the trend; a plain full run carries them over from the last result."""


def extended_only(row: dict) -> bool:
    """Whether a row is one only --extended runs."""
    return row["codec"] in EXTENDED_CODECS or row["H"] in EXTENDED_H


def row_key(row: dict) -> tuple:
    """What tells two rows of the grid apart."""
    return row["codec"], row["H"], row.get("seed", 0), row.get("wide", False)


def carry_over(rows: list[dict], earlier: dict) -> tuple[list[dict], dict[str, str]]:
    """The extended rows of the `earlier` result that `rows` lack, added; and when each was measured, by codec@H."""
    ran = {row_key(row) for row in rows}
    carried = [row for row in earlier.get("rows", []) if extended_only(row) and row_key(row) not in ran]
    dates = earlier.get("carried_over", {})
    when = {
        f"{row['codec']}@H{row['H']}": dates.get(f"{row['codec']}@H{row['H']}", earlier.get("date")) for row in carried
    }
    return carried + rows, when


def summarise(rows: list[dict], grid: dict[int, int]) -> dict:
    """The figures at the largest H (means over its seeds), and per H."""
    target_h = max(grid)
    at_target = mean_rows(rows, target_h)
    fp32_loss = at_target["fp32"]["final_eval_loss"] if "fp32" in at_target else None
    return {
        "H": target_h,
        "seeds": sorted({row["seed"] for row in rows if row["H"] == target_h}),
        **{figure: {c: row[figure] for c, row in at_target.items()} for figure in FIGURES},
        "final_eval_spread": {c: row["eval_spread"] for c, row in at_target.items()},
        "chatter_fit": chatter_fit(rows),
        "loss_vs_fp32": {
            c: (row["final_eval_loss"] / fp32_loss - 1.0) if fp32_loss and row["final_eval_loss"] else None
            for c, row in at_target.items()
        },
        "tcp_over_payload_steady_wide": {
            row["codec"]: {key: row[key] for key in WIDE_FIGURES} for row in rows if row.get("wide")
        },
        "by_H": {
            str(h): {figure: {c: row[figure] for c, row in mean_rows(rows, h).items()} for figure in FIGURES}
            for h in grid
        },
    }


NOTES = (
    "Payload bytes are what the all-reduce sends (each island sends (M-1)/M of its vector to the other "
    "reducers and returns the averaged part it reduced to the others, so about 2(M-1)/M values per "
    "round); the data-parallel baseline is the issue's 2*P*4 bytes per step. TCP bytes also count libp2p "
    "framing, encryption, DHT announces and matchmaking, which weigh more on small models. "
    "tcp_over_payload counts from each island's start (its join, DHT bootstrap and first matchmaking "
    "included); tcp_over_payload_steady counts from the end of its first round. chatter_by_round is "
    "[seconds waited for the group, TCP bytes beyond the payload] per island and round after the first; "
    "chatter_fit fits those as a fixed cost per round plus a cost per second of waiting."
)


def main(argv: list[str] | None = None) -> int:
    """Run every (H, codec) and write bandwidth.json and bandwidth.png (bandwidth-smoke.* with --smoke)."""
    parser = benchmark_parser(
        __doc__,
        quick="tiny model, H = 100 only, fp32 int4 topk",
        smoke="fp32, int8 and topk, 2 islands, tiny model, H = 10",
        out="where the JSON and PNG go",
        extended="also fp16, bf16 and H = 50 (else carried over from the last result, dated)",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per swarm before it is stopped")
    parser.add_argument("--seeds", type=int, help="seeds at the largest H (default 3; 1 with --quick or --smoke)")
    parser.add_argument(
        "--seeded-codecs",
        nargs="+",
        choices=CODECS,
        default=SEEDED,
        help="codecs that run every seed at the largest H (default: fp32 int2 topk; the others run seed 0)",
    )
    parser.add_argument(
        "--codecs",
        nargs="+",
        choices=CODECS,
        help="rerun only these codecs; the others keep their rows from the existing OUT/bandwidth.json",
    )
    parser.add_argument(
        "--rescan",
        action="store_true",
        help="run nothing: rebuild the result from the grid's metrics under OUT/bandwidth-runs (after adding a "
        "figure, or rerunning some codecs with --codecs)",
    )
    args = parser.parse_args(argv)
    args.islands, args.tiny = 4, False
    grid = {50: 4, 100: 2}  # H -> outer steps: every H sees the same number of tokens
    codecs = CODECS
    if args.quick:  # the codecs that span the range: full precision, the densest low-bit one, sparse
        args.tiny, grid, codecs = True, {100: 2}, ["fp32", "int4", "topk"]
    if args.smoke:
        args.tiny, args.islands, grid, codecs = True, 2, {10: 2}, ["fp32", "int8", "topk"]
    codecs = args.codecs or codecs
    seeds = args.seeds or (1 if args.smoke or args.quick else 3)
    runs = args.out / "bandwidth-runs"
    name = "bandwidth-smoke" if args.smoke else "bandwidth"
    previous = args.out / f"{name}.json"
    earlier = json.loads(previous.read_text()) if previous.exists() else {}
    args.previous_rows = earlier.get("rows", [])
    skip_extended = not (args.extended or args.quick or args.smoke or args.codecs or args.rescan)
    rows = [
        (rescan_one if args.rescan else run_one)(codec, h, steps, args, runs, seed)
        for h, steps in grid.items()
        for seed in range(seeds if h == max(grid) else 1)
        for codec in codecs
        if (seed == 0 or codec in args.seeded_codecs)
        and (h == max(grid) or codec in SHORTER_H_CODECS)
        and not (skip_extended and extended_only({"codec": codec, "H": h}))
    ]
    if not (args.quick or args.smoke):  # the wider model, at the largest H, seed 0
        target_h = max(grid)
        rows += [
            (rescan_one if args.rescan else run_one)(codec, target_h, grid[target_h], args, runs, 0, True)
            for codec in WIDE_CODECS
            if codec in codecs
        ]
    if args.codecs and not args.rescan:  # a partial rerun: the other codecs keep their rows
        rows = [row for row in args.previous_rows if row["codec"] not in codecs] + rows
    carried: dict[str, str] = {}
    if skip_extended:
        rows, carried = carry_over(rows, earlier)
    elif args.codecs and not args.rescan:  # rows kept from a plain run's carry-over keep their dates
        carried = {
            key: when for key, when in earlier.get("carried_over", {}).items() if key.split("@")[0] not in codecs
        }
    result = {
        **summarise(rows, grid),
        "targets": {
            "int8_ratio_at_H100": 400,
            "int4_ratio_at_H100": 800,
            "topk_ratio_at_H100": 10_000,
            "topk_loss_within": 0.01,
            "tcp_over_payload": 1.5,
            "tcp_over_payload_steady": 1.5,
        },
        "rows": rows,
        "notes": NOTES,
        **provenance("bandwidth.py", argv),
        **({"carried_over": carried} if carried else {}),
    }
    if args.rescan and earlier:  # the figures come from the earlier runs: keep their command and date
        result.update({key: earlier[key] for key in ("command", "date", "machine") if key in earlier})
        result["rescanned"] = provenance("bandwidth.py", argv)
    path = write_result(args.out, name, result)
    plot(rows, args.out / f"{name}.png")
    print(f"wrote {path} and {name}.png")
    failed = [row for row in rows if any(code != 0 for code in row["exit_codes"] or [])]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
