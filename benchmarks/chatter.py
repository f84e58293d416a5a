"""Where the chatter goes: every hivemind RPC of a small swarm, charged to what it served.

`bandwidth.py` measures chatter as TCP bytes minus payload; this names its parts. A bootstrap and 4 islands
(tiny model, top-k codec, quorum 4, so every round is one group of all four) run with a counting shim on their
PYTHONPATH (`benchmarks/lib/rpc_count/sitecustomize.py`) that records the protobuf bytes of each RPC their
processes make and the DHT key each DHT request was for. Bytes are counted once, at the caller (request plus
response), from the end of the last island's first round to the end of the first island's last round (join and
leave excluded), and divided by the island-rounds in that window. Libp2p framing and encryption come on top (the
TCP figure of `bandwidth.py`); payload on direct lanes is not an RPC and is reported from the islands' own
counters.

    python benchmarks/chatter.py            # 4 islands, H = 20, 16 rounds (about 1 minute)
    python benchmarks/chatter.py --quick    # the same, 6 rounds
    python benchmarks/chatter.py --smoke    # 2 islands, 6 rounds, announcing every 2 (used by the tests)
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path

from lib.common import BENCHMARKS, TINY, benchmark_parser, provenance, run_islands, write_result

SHIM = BENCHMARKS / "lib" / "rpc_count"
# mode: islands, inner steps, outer steps
MODES = {"full": (4, 20, 16), "quick": (4, 20, 6), "smoke": (2, 10, 6)}
KINDS = [
    (re.compile(r"\.islands$"), "island records (announce)"),
    (re.compile(r"\.0b[01]*$"), "matchmaking (group keys)"),
    (re.compile(r"\.all_averagers$"), "state donors (declare)"),
    (re.compile(r"^p2p-diloco\.runs$"), "run registry"),
    (re.compile(r"relay"), "relay list"),
]


def kind_of_key(name: str) -> str:
    """What a DHT key is for, from its name."""
    return next((kind for pattern, kind in KINDS if pattern.search(name)), "other DHT keys")


def parse_counts(path: Path) -> tuple[list[tuple[float, str, str, int, int]], dict[str, str]]:
    """The shim's RPC lines (time, rpc, key id, sent, received) and the DHT key names by key id."""
    rpcs, names = [], {}
    for line in path.read_text().splitlines():
        fields = line.split(" ", 5)
        if len(fields) >= 5 and fields[1] == "key":
            names[fields[3]] = fields[4]
        elif len(fields) == 6 and fields[1] == "rpc":
            rpcs.append((float(fields[0]), fields[2], fields[3], int(fields[4]), int(fields[5])))
    return rpcs, names


def steady_window(records: dict[str, list[dict]]) -> tuple[float, float, int]:
    """(start, end, island-rounds): from the last island's first round to the first island's last round."""
    start = max(recs[0]["time"] for recs in records.values())
    end = min(recs[-1]["time"] for recs in records.values())
    rounds = sum(1 for recs in records.values() for r in recs if start < r["time"] <= end)
    return start, end, rounds


def breakdown(rpcs: list, names: dict[str, str], window: tuple[float, float, int]) -> list[dict]:
    """Bytes and calls per (what, rpc) inside the window, per island-round, largest first."""
    start, end, rounds = window
    totals: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for at, rpc, key, sent, received in rpcs:
        if not start < at <= end:
            continue
        method = rpc.rsplit(".", 1)[-1]
        what = kind_of_key(names.get(key, "")) if rpc.startswith("DHTProtocol.") else "averager: " + method
        totals[(what, method)][0] += 1
        totals[(what, method)][1] += sent + received
    rows = [
        {"what": what, "rpc": method, "calls": calls, "bytes": size, "bytes_per_island_round": size / max(1, rounds)}
        for (what, method), (calls, size) in totals.items()
    ]
    return sorted(rows, key=lambda row: -row["bytes"])


def by_what(rows: list[dict]) -> dict[str, float]:
    """Bytes per island-round for each thing the chatter served, all its RPCs together."""
    out: dict[str, float] = defaultdict(float)
    for row in rows:
        out[row["what"]] += row["bytes_per_island_round"]
    return dict(sorted(out.items(), key=lambda item: -item[1]))


def payload_per_round(records: dict[str, list[dict]], window: tuple[float, float, int]) -> float:
    """Payload bytes the islands sent per island-round inside the window (their own all-reduce counters)."""
    start, end, rounds = window
    sent = sum(r.get("bytes_sent") or 0 for recs in records.values() for r in recs if start < r["time"] <= end)
    return sent / max(1, rounds)


def plot(result: dict, path: Path) -> None:
    """Two bars per thing the chatter served (replica-first, and every read and write walking), payload beside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    walks = result.get("hivemind_walks", {})
    names = list(dict.fromkeys([*result["chatter_by_what"], *walks.get("chatter_by_what", {})]))
    labels = [*names, "payload (top-k)"]
    ours = [result["chatter_by_what"].get(n, 0.0) for n in names] + [result["payload_bytes_per_island_round"]]
    theirs = [walks.get("chatter_by_what", {}).get(n, 0.0) for n in names]
    theirs.append(walks.get("payload_bytes_per_island_round", 0.0))
    fig, axes = plt.subplots(figsize=(8, 0.55 * len(labels) + 1.2))
    at = list(range(len(labels)))[::-1]
    axes.barh([y + 0.2 for y in at], [v / 1000 for v in ours], height=0.4, color="tab:blue", label="replica-first")
    axes.barh([y - 0.2 for y in at], [v / 1000 for v in theirs], height=0.4, color="tab:gray", label="every op walks")
    axes.set_yticks(at, labels)
    axes.set_xlabel("KB per island and round (request + response, protobuf)")
    axes.set_title(f"chatter of {result['islands']} islands, steady state")
    axes.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def count_swarm(folder: Path, name: str, flags: list[str], islands: int) -> dict:
    """One counted swarm: its RPC breakdown in the steady window, per island-round."""
    counts = folder / "rpc-counts.txt"
    folder.mkdir(parents=True, exist_ok=True)
    counts.unlink(missing_ok=True)
    os.environ["P2P_DILOCO_RPC_COUNT"] = str(counts)
    records, codes, wall = run_islands(
        folder / "swarm", name, islands, flags, per_island=lambda index: ["--shard-index", str(index)]
    )
    if any(code != 0 for code in codes):
        raise SystemExit(f"chatter.py: islands exited with {codes}; logs under {folder / 'swarm'}")
    rpcs, names = parse_counts(counts)
    window = steady_window(records)
    rows = breakdown(rpcs, names, window)
    return {
        "island_rounds_counted": window[2],
        "window_s": window[1] - window[0],
        "chatter_by_what": by_what(rows),
        "rpc_bytes_per_island_round": sum(row["bytes_per_island_round"] for row in rows),
        "payload_bytes_per_island_round": payload_per_round(records, window),
        "rows": rows,
        "wall_s": wall,
    }


def print_swarm(label: str, swarm: dict) -> None:
    """The breakdown of one counted swarm."""
    print(f"-- {label}")
    for row in swarm["rows"]:
        print(
            f"  {row['what']:32s} {row['rpc']:22s} {row['calls']:5d} calls  "
            f"{row['bytes_per_island_round'] / 1000:7.1f} KB per island-round"
        )
    print(
        f"RPCs {swarm['rpc_bytes_per_island_round'] / 1000:.1f} KB per island-round over "
        f"{swarm['island_rounds_counted']} island-rounds; top-k payload "
        f"{swarm['payload_bytes_per_island_round'] / 1000:.1f} KB"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the counted swarms, print the breakdown and write chatter.json and chatter.png."""
    parser = benchmark_parser(__doc__, quick="6 rounds", smoke="2 islands, 6 rounds (used by the tests)")
    args = parser.parse_args(argv)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    islands, inner_steps, outer_steps = MODES[mode]
    name = "chatter-smoke" if args.smoke else "chatter"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SHIM), os.environ.get("PYTHONPATH")]))
    flags = ["--inner-steps", str(inner_steps), "--outer-steps", str(outer_steps), "--codec", "topk"]
    flags += ["--num-shards", str(islands), "--quorum", str(islands), "--target-group-size", str(islands)]
    flags += ["--averaging-timeout", "120", "--config", str(TINY)]
    if args.smoke:  # announces every 2 rounds, so that a few rounds are sure to hold some
        flags += ["--announce-every", "2"]
    print(f"chatter ({mode}): {islands} islands, topk, H={inner_steps}, {outer_steps} rounds", flush=True)
    swarm = count_swarm(args.out / f"{name}-runs", name, flags, islands)
    print_swarm("replica-first reads and writes (default)", swarm)
    walks = count_swarm(args.out / f"{name}-walks-runs", name, flags + ["--dht-walk-every", "1"], islands)
    print_swarm("every read and write walks the DHT (--dht-walk-every 1, hivemind's way)", walks)
    result = {
        **provenance("chatter.py", argv),
        "islands": islands,
        "inner_steps": inner_steps,
        "outer_steps": outer_steps,
        **swarm,
        "hivemind_walks": walks,
        "replica_first_vs_walks": swarm["rpc_bytes_per_island_round"] / max(1.0, walks["rpc_bytes_per_island_round"]),
        "notes": "protobuf bytes of each RPC (request + response) at its caller, between the last island's first "
        "round and the first island's last round, per island-round; libp2p framing and encryption not included. "
        "hivemind_walks: the same swarm with --dht-walk-every 1 (every DHT read and write walks, as hivemind does)",
    }
    print(f"replica-first / walks: {result['replica_first_vs_walks']:.2f}")
    path = write_result(args.out, name, result)
    plot(result, args.out / f"{name}.png")
    print(f"wrote {path} and {name}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
