"""A restart where the state transfer is real: two islands on separate hosts whose uplinks are shaped with tc tbf.

`restart.py` restarts an island of the default model (1.75 MB) on loopback: its state arrives in about 0.1 s, so
restart-to-first-merge over the state transfer only measures the fixed start-up cost (Python, torch and hivemind
imports, joining). Here each island is in a network namespace of its own whose uplink is shaped to `--rate-mbit`
(as in `link.py`), the model is a GPT of about 10M parameters (a 38 MB pseudo-gradient, the 40 MB of link.py;
--extended adds 38M, a 305 MB state that takes longer to download than the surviving island takes per round), and
island 1 is SIGKILLed (with its p2pd) after a merged round and started again at once, `--restarts` times. Each
restart downloads the swarm's outer state (anchor and Nesterov momentum: 77 MB at 10M) from island 0 over the link.

Each restart's first metrics record names its start-up phases (process_start_s, join_s, restore_s: the state
transfer, download included); first_round_s is the rest until its first merged round (its inner steps and one
exchange of the pseudo-gradient over the link). The donor sends the anchor first, and the island trains its first
round on it while the rest of the state (the outer momentum) downloads: anchor_s is how far into restore_s that
training began, and first_round_s holds only the inner steps the download did not cover. `total_over_restore` is
restart-to-first-merge over the state transfer as the island timed it (restore_s: asking donors, waiting for a
donor's round in flight to land, the download); `total_over_transfer_limit` divides by the state's bytes at the
link's rate instead, the stricter one.

    python benchmarks/restart_link.py             # 10M parameters, 100 Mbit/s, int8, 3 restarts (~3.5 minutes)
    python benchmarks/restart_link.py --extended  # and 10M fp32, 38M int8 (a 305 MB state): ~13 minutes in all
    python benchmarks/restart_link.py --quick     # 10M, int8, 1 restart
    python benchmarks/restart_link.py --smoke     # the tiny model, 1 restart (used by the tests)

Needs root, iproute2 and iptables (network namespaces); elsewhere it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
from pathlib import Path

from lib import netns
from lib.common import TINY, benchmark_parser, provenance, write_result
from restart import PHASES, first_merge_after, restart_once

from p2p_diloco.cli.launcher import LocalSwarm

MODEL_TOML = """[model]
seq_len = 64
d_model = {d_model}
n_layers = 3
n_heads = 8
"""
SIZES = {"10M": 512, "38M": 1024, "tiny": 0}
"""Model sizes by parameters (the GPT's width; 3 blocks): 10M is link.py's 40 MB pseudo-gradient, a 77 MB state;
tiny is peers/tiny.toml (the tests')."""
FLAGS = ["--num-shards", "2", "--outer-steps", "100000", "--batch-size", "4", "--target-group-size", "2"]
INNER_STEPS = 5
"""Short rounds (about 1.3 s of inner steps here), so that a round of the surviving island lands during most
restarts' state transfer: the case where the state a newcomer downloads can be stale on arrival."""
BURST_TICKS = 2
"""tbf's bucket holds this many kernel ticks (4 ms at HZ 250) of traffic, and never less than 64 KiB."""


def run_restarts(restarts: int, rate_mbit: float, config: Path, flags: list[str], folder: Path) -> list[dict]:
    """Two islands on shaped hosts, a bootstrap on an unshaped one; island 1 restarted `restarts` times."""
    rows = []
    burst_kb = max(64, math.ceil(rate_mbit * 1e6 / 8 / 250 * BURST_TICKS / 1024))
    shutil.rmtree(folder, ignore_errors=True)  # an earlier run's checkpoints would be resumed from
    with netns.Internet() as internet, LocalSwarm(folder, run_id="restart-link") as swarm:
        boot = internet.public_host("boot")
        swarm.bootstrap(host=boot.address, command_prefix=boot.prefix)
        for index in range(2):
            host = internet.public_host(f"i{index}")
            internet.shape(host, rate_mbit, burst_kb=burst_kb)
            args = ["--shard-index", str(index), *flags, *FLAGS]
            swarm.peer(f"island-{index}", *args, config=config, host=host.address, command_prefix=host.prefix)
        first_merge_after(swarm, "island-1", 0.0)
        for number in range(restarts):
            row = restart_once(swarm, "shipped", same_host=True)
            rows.append(row)
            print(
                f"restart {number + 1}/{restarts}: "
                + ", ".join(f"{phase} {row[phase]:.2f}" for phase in PHASES)
                + f", total {row['total_s']:.2f} s ({row['total_over_restore']:.2f}x the state transfer)",
                flush=True,
            )
    return rows


def state_bytes(config: Path) -> int:
    """Bytes of the outer state a restart downloads: the anchor and the momentum, fp32."""
    from p2p_diloco.config import load_config
    from p2p_diloco.train.model import build_model, count_parameters

    return 2 * 4 * count_parameters(build_model(load_config(config).model, seed=0))


def summary(rows: list[dict], limit: float) -> dict:
    """Median phases of one codec's restarts, and restart-to-first-merge over the transfer both ways."""
    median = {key: statistics.median(row[key] for row in rows) for key in (*PHASES, "total_s")}
    median["total_over_restore"] = median["total_s"] / median["restore_s"]
    median["total_over_transfer_limit"] = median["total_s"] / limit
    median["restore_over_transfer_limit"] = median["restore_s"] / limit
    median["second_downloads"] = sum(row["resynced"] for row in rows)
    early = [row["anchor_s"] for row in rows if row.get("anchor_s") is not None]
    median["anchor_s"] = statistics.median(early) if early else None
    median["trained_during_download"] = len(early)
    return median


def configurations(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(size, codec) pairs to run: the flags' product, else each mode's defaults."""
    if args.sizes or args.codecs:
        return [(size, codec) for size in args.sizes or ["10M"] for codec in args.codecs or ["fp32", "int8"]]
    if args.smoke:
        return [("tiny", "fp32")]
    if args.quick:
        return [("10M", "int8")]
    return [("10M", "int8")] + ([("10M", "fp32"), ("38M", "int8")] if args.extended else [])


def model_config(size: str, folder: Path) -> Path:
    """The config file of a model size (the shipped tiny one, or a GPT written into `folder`)."""
    if size == "tiny":
        return TINY
    path = folder / f"model-{size}.toml"
    path.write_text(MODEL_TOML.format(d_model=SIZES[size]))
    return path


def carry_over(result: dict, previous_path: Path) -> None:
    """Keep the configurations this run left out (a plain run after an --extended one) from the last result at the
    same rate, each marked with the date it ran (`carried_over`)."""
    try:
        previous = json.loads(previous_path.read_text())
    except (OSError, ValueError):
        return
    if previous.get("rate_mbit") != result["rate_mbit"]:
        return
    dates = previous.get("carried_over", {})
    for label, figures in previous.get("configs", {}).items():
        if label not in result["configs"]:
            result["configs"][label] = figures
            result["restarts"] += [r for r in previous.get("restarts", []) if f"{r['size']} {r['codec']}" == label]
            result.setdefault("carried_over", {})[label] = dates.get(label, previous.get("date"))


def main(argv: list[str] | None = None) -> int:
    """Restart an island over a shaped link, for each model size and codec; write restart_link.json."""
    parser = benchmark_parser(
        __doc__, quick="10M int8, 1 restart", smoke="the tiny model, 1 restart", extended="and 10M fp32, 38M int8"
    )
    parser.add_argument("--rate-mbit", type=float, default=100.0, help="each island's uplink, Mbit/s")
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=None, help="model sizes (10M)")
    parser.add_argument("--codecs", nargs="+", default=None, help="pseudo-gradient codecs (fp32 int8)")
    parser.add_argument("--restarts", type=int, default=None, help="restarts of each (default 3; --quick 1)")
    args = parser.parse_args(argv)
    reason = netns.available()
    if reason is not None:
        print(f"restart_link.py needs network namespaces: {reason}", file=sys.stderr)
        return 2
    restarts = args.restarts or (1 if args.smoke or args.quick else 3)
    name = "restart_link-smoke" if args.smoke else "restart_link"
    folder = args.out / f"{name}-runs"
    folder.mkdir(parents=True, exist_ok=True)
    results, rows = {}, []
    for size, codec in configurations(args):
        config = model_config(size, folder)
        state = state_bytes(config)
        limit = state / (args.rate_mbit * 1e6 / 8)
        label = f"{size} {codec}"
        print(f"{label}: {restarts} restarts, a {state / 1e6:.0f} MB state over {args.rate_mbit:g} Mbit/s", flush=True)
        flags = ["--inner-steps", str(INNER_STEPS), "--codec", codec]
        found = run_restarts(restarts, args.rate_mbit, config, flags, folder / label.replace(" ", "-"))
        rows += [{"size": size, "codec": codec, **row} for row in found]
        results[label] = {"size": size, "codec": codec, "state_bytes": state, "transfer_limit_s": limit}
        results[label].update(summary(found, limit))
        figures = {key: value for key, value in summary(found, limit).items() if value is not None}
        print(f"{label}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()), flush=True)
    result = {
        **provenance("restart_link.py", argv),
        "rate_mbit": args.rate_mbit,
        "inner_steps": INNER_STEPS,
        "configs": results,
        "restarts": rows,
    }
    if not args.smoke:
        carry_over(result, args.out / f"{name}.json")
    path = write_result(args.out, name, result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
