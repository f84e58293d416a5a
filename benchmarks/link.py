"""Rounds at link speed: islands on separate hosts whose uplinks are shaped with tc tbf.

Every island is a peer of the exchange benchmark (`exchange.py --worker`) in a network namespace of its own,
plugged into one bridge ("the internet") by a veth whose sending side is shaped to `--rates` Mbit/s. Each round
averages one pseudo-gradient of `--values` fp32 values (10M = 40 MB) with p2p-diloco's exchange
(`GossipExchange.average`: matchmaking, the all-or-nothing all-reduce, the codec). gloo's ring all-reduce over
the same links is the reference for what TCP itself achieves there.

The limit is what a bandwidth-optimal all-reduce must upload from every island, 2 (N - 1) / N x payload, at the
link's rate; `ratio_to_limit` is seconds per round over that.

Each island is told its uplink (`--uplink-mbit`, as a user who knows it would): its lanes share it evenly and send
its own parts before its replies (`p2p_diloco.net.pacing`). Rows with `paced: false` leave the sharing to TCP, for
comparison: the full run adds them at 100 Mbit/s for int8, `--unpaced` makes every row so.

    python benchmarks/link.py            # 2 and 4 islands: 100 Mbit/s x fp32, int8, int4; 1 Gbit/s x fp32 (+ gloo)
    python benchmarks/link.py --quick    # 2 islands, 100 Mbit/s, fp32 and int8, 3 rounds
    python benchmarks/link.py --smoke    # 1M values, 2 islands, 100 Mbit/s, fp32, 1 round (used by the tests)

Needs root, iproute2 and iptables (network namespaces); elsewhere it says so and exits 2.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import tempfile
import time
from pathlib import Path

from lib import netns
from lib.common import benchmark_parser, provenance, write_result
from lib.exchange_runs import run_config

DEFAULT_CODECS = ["fp32", "int8", "int4"]
BURST_TICKS = 2
"""tbf's bucket holds this many kernel ticks (4 ms at HZ 250) of traffic, and never less than 64 KiB."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The benchmark's flags."""
    quick, smoke = "2 islands, 100 Mbit/s, fp32 and int8, 3 rounds", "1M values, 2 islands, fp32, one round"
    parser = benchmark_parser(__doc__, quick=quick, smoke=smoke)
    parser.add_argument("--values", type=int, help="fp32 values in the pseudo-gradient (default 10M = 40 MB)")
    parser.add_argument("--islands", type=int, nargs="+", help="islands per round (default 2 4)")
    parser.add_argument("--rates", type=float, nargs="+", help="link rates in Mbit/s (default 100 1000)")
    parser.add_argument("--codecs", nargs="+", help="codecs (default fp32 int8 int4; fp32 above 100 Mbit/s)")
    parser.add_argument("--rounds", type=int, help="timed rounds per configuration (default 5; --quick 3)")
    parser.add_argument("--queue-ms", type=int, default=400, help="tbf's queue, in ms of traffic (default 400)")
    parser.add_argument("--no-gloo", action="store_true", help="skip gloo's reference rows")
    parser.add_argument("--unpaced", action="store_true", help="islands not told their uplink: TCP shares it")
    parser.add_argument("--logs", type=Path, help="keep the islands' logs in this folder")
    return parser.parse_args(argv)


def payload_bytes(codec: str, values: int) -> int:
    """One island's whole pseudo-gradient as its codec puts it on the wire (block scales in, frame headers out)."""
    from p2p_diloco.net.codecs import bits_per_value

    return math.ceil(values * bits_per_value(codec) / 8)


def limit_seconds(payload: int, islands: int, rate_mbit: float) -> float:
    """What a bandwidth-optimal all-reduce needs: every island uploads 2 (N - 1) / N of the payload."""
    return 2 * (islands - 1) / islands * payload * 8 / (rate_mbit * 1e6)


def run_link(
    system: str, codec: str, islands: int, rate_mbit: float, paced: bool, args: argparse.Namespace, **timing
) -> dict:
    """One configuration on fresh hosts: `islands` namespaces on a bridge, each uplink shaped to `rate_mbit`
    (and each island told so if `paced`)."""
    with netns.Internet() as internet:
        hosts = [internet.public_host(f"i{index}") for index in range(islands)]
        burst_kb = max(64, math.ceil(rate_mbit * 1e6 / 8 / 250 * BURST_TICKS / 1024))
        for host in hosts:
            internet.shape(host, rate_mbit, burst_kb=burst_kb, latency_ms=args.queue_ms)
        row = run_config(
            system,
            args.values,
            islands,
            **timing,
            codec=codec,
            hosts=hosts,
            wire=lambda: sum(internet.sent_bytes(host) for host in hosts),
            uplink_mbit=rate_mbit if paced else 0.0,
        )
    payload = payload_bytes(codec, args.values)
    limit = limit_seconds(payload, islands, rate_mbit)
    seconds = row.get("seconds")
    row["round_seconds"] = row.pop("seconds_per_round", None)  # each timed round's slowest island
    failed = sum(1 for failure in row.get("failures", []) if failure.get("error"))
    sent = row.get("bytes_sent_per_peer_per_round")
    wire = row.get("wire_bytes_per_peer_per_round")
    row.update(
        islands=islands,
        rate_mbit=rate_mbit,
        paced=paced if system == "p2p_diloco" else None,
        payload_bytes=payload,
        limit_s=limit,
        seconds_per_round=seconds,
        ratio_to_limit=seconds / limit if seconds else None,
        burst_kb=burst_kb,
        failed_island_rounds=failed,
        # What the averager sent against what left the host: TCP/IP, TLS and yamux framing, DHT and matchmaking.
        wire_over_sent=wire / sent if wire and sent else None,
        sent_over_optimal=sent / (limit * rate_mbit * 1e6 / 8) if sent else None,
    )
    return row


def configurations(args: argparse.Namespace) -> list[tuple[str, str, int, float, bool]]:
    """(system, codec, islands, rate, paced) in run order: each rate and group size, gloo's fp32 first.

    Without `--codecs`, links faster than 100 Mbit/s run fp32 only: there the codecs' CPU, not the link, is the
    limit on 2 cores, which the 100 Mbit/s rows already show. The full run (not --quick or --smoke) adds int8
    unpaced at 100 Mbit/s, beside the paced rows.
    """
    runs = []
    for rate in args.rates:
        codecs = args.codecs or (DEFAULT_CODECS if rate <= 100 else ["fp32"])
        for islands in args.islands:
            if not args.no_gloo:
                runs.append(("gloo", "fp32", islands, rate, False))
            runs += [("p2p_diloco", codec, islands, rate, not args.unpaced) for codec in codecs]
            if rate == 100 and not (args.unpaced or args.quick or args.smoke or args.codecs):
                runs.append(("p2p_diloco", "int8", islands, rate, False))
    return runs


def system_label(row: dict) -> str:
    """The row's system, marked where its islands left the uplink's sharing to TCP."""
    return row["system"] + (" unpaced" if row.get("paced") is False else "")


def print_table(rows: list[dict]) -> None:
    """The rows as a table: seconds per round against the link's limit."""
    print(f"{'Mbit/s':>7} {'islands':>7} {'system':>19} {'codec':>5} {'payload MB':>10} {'s/round':>8}")
    for row in rows:
        seconds = row.get("seconds_per_round")
        shown = f"{seconds:8.2f} (limit {row['limit_s']:.2f} s, {row['ratio_to_limit']:.2f}x)" if seconds else "failed"
        print(
            f"{row['rate_mbit']:7g} {row['islands']:7d} {system_label(row):>19} {row['codec']:>5} "
            f"{row['payload_bytes'] / 1e6:10.1f} {shown}"
        )


def plot(rows: list[dict], path: Path) -> None:
    """Seconds per round over the link's limit, by configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [row for row in rows if row.get("ratio_to_limit")]
    labels = [
        f"{r['rate_mbit']:g} Mbit/s\n{r['islands']} isl.\n{r['system'][:5]} {r['codec']}"
        + ("\nunpaced" if r.get("paced") is False else "")
        for r in done
    ]
    figure, axes = plt.subplots(figsize=(max(6, 0.8 * len(done)), 4))
    colors = ["#999999" if r["system"] == "gloo" else "#c9a227" if r.get("paced") is False else "#3b6ea8" for r in done]
    axes.bar(range(len(done)), [r["ratio_to_limit"] for r in done], color=colors)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.axhline(1.25, color="#c44e52", linestyle="--", linewidth=0.8, label="target: 1.25x the limit")
    axes.set_xticks(range(len(done)), labels, fontsize=7)
    axes.set_ylabel("seconds per round / (2(N-1)/N x payload / rate)")
    axes.set_title("One round on shaped links (grey: gloo fp32; yellow: unpaced lanes)")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    """Run every configuration and write link.json and link.png (link-smoke.* with --smoke)."""
    args = parse_args(argv)
    why_not = netns.available()
    if why_not:
        print(f"link.py: {why_not}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: namespaces, workers
    smoke = args.smoke
    args.values = args.values or (1_000_000 if smoke else 10_000_000)
    args.islands = args.islands or ([2] if smoke or args.quick else [2, 4])
    args.rates = args.rates or ([100.0] if smoke or args.quick else [100.0, 1000.0])
    args.codecs = args.codecs or (["fp32"] if smoke else ["fp32", "int8"] if args.quick else None)
    rounds = args.rounds or (1 if smoke else 3 if args.quick else 5)  # a median of 5 stands two slow or failed rounds
    started, rows = time.monotonic(), []
    with tempfile.TemporaryDirectory(prefix="link-bench-") as tmp, tempfile.TemporaryDirectory(dir="/tmp") as sock:
        logs = args.logs or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        timing = dict(warmup=1, rounds=rounds, logs=logs, socket_dir=Path(sock))
        for system, codec, islands, rate, paced in configurations(args):
            shared = "" if system == "gloo" else " paced" if paced else " unpaced"
            print(f"== {rate:g} Mbit/s, {islands} islands, {system} {codec}{shared} ...", flush=True)
            row = run_link(system, codec, islands, rate, paced, args, **timing)
            rows.append(row)
            if row.get("seconds"):
                print(
                    f"   {row['seconds']:.2f} s/round, limit {row['limit_s']:.2f} s: "
                    f"{row['ratio_to_limit']:.2f}x (wall {row['wall_s']:.0f}s)",
                    flush=True,
                )
    result = {
        **provenance("link.py", argv),
        "definitions": {
            "payload_bytes": "one island's pseudo-gradient in its codec (block scales in, 12-byte frames out)",
            "limit_s": "2 (N - 1) / N x payload_bytes x 8 / rate: the upload of a bandwidth-optimal all-reduce",
            "seconds_per_round": "median over timed rounds of the slowest island's GossipExchange.average() call "
            "(gloo: all_reduce after a barrier); round_seconds lists the rounds",
            "failed_island_rounds": "island-rounds that ended without a merge (e.g. 'could not find a group')",
            "streams_repaired": "reply streams that broke in the timed rounds and whose missing parts the member "
            "fetched from the reducer again (the round then completed for every member)",
            "ratio_to_limit": "seconds_per_round / limit_s",
            "paced": "the islands were told their uplink (--uplink-mbit): lanes share it evenly, own parts before "
            "replies; false: TCP shares it",
            "wire_bytes_per_peer_per_round": "bytes each host sent on its link per timed round (Ethernet frames)",
            "bytes_sent_per_peer_per_round": "bytes each island's averager sent (its parts and replies)",
        },
        "settings": {"values": args.values, "rounds": rounds, "warmup_rounds": 1, "shaping": "tc tbf on each uplink"},
        "rows": rows,
        "runtime_s": time.monotonic() - started,
    }
    name = "link-smoke" if smoke else "link"
    path = write_result(args.out, name, result)
    plot(rows, args.out / f"{name}.png")
    print()
    print_table(rows)
    print(f"\nwrote {path} and {args.out / (name + '.png')} in {result['runtime_s']:.0f}s")
    return 0 if all(row.get("correct") for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
