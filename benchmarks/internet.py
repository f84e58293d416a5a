"""Direct vs relayed islands on separate hosts: time to join and seconds per round, same model, same rounds.

Builds a little internet of network namespaces (benchmarks/lib/netns.py: a bridge, a public bootstrap, and two
islands either on public hosts or each behind its own NAT router that drops inbound connections) and runs two
islands of the tiny model with exactly the line the bootstrap prints. Reports, per setting, each island's join
time (from start to "joined run", as the island measures it, and the wall time until its first record), the mean
seconds per round after the first, merged rounds, and what `p2p-diloco status --json` printed at the end. Needs
root and iproute2/iptables; prints why and writes nothing otherwise.

    python benchmarks/internet.py            # 12 outer steps per setting
    python benchmarks/internet.py --quick    # 4
    python benchmarks/internet.py --smoke    # 3
"""

from __future__ import annotations

import json
import shlex
import statistics
import sys
import time
from pathlib import Path

from lib.common import TINY, benchmark_parser, provenance, write_result
from lib.netns import Internet, available

from p2p_diloco.cli.launcher import LocalSwarm

STEPS = {"smoke": 3, "quick": 4, "full": 12}


def setting(folder: Path, relayed: bool, steps: int) -> dict:
    """Two islands (public, or each behind a NAT) and a public bootstrap; their join and round figures."""
    with Internet() as internet:
        boot = internet.public_host("boot")
        hosts = [internet.nat_host(f"n{i}") if relayed else internet.public_host(f"p{i}") for i in range(2)]
        swarm = LocalSwarm(folder, run_id="internet")
        try:
            swarm.bootstrap(host=None, command_prefix=boot.prefix)
            line = shlex.split(swarm.bootstrap_process.join_line)[2:]
            flags = ["--outer-steps", str(steps), "--quorum", "2", "--num-shards", "2", "--averaging-timeout", "30"]
            started = time.monotonic()
            peers = [
                swarm.peer(
                    f"island-{i}",
                    *line,
                    *flags,
                    "--shard-index",
                    str(i),
                    config=TINY,
                    join=False,
                    host=None,
                    command_prefix=hosts[i].prefix,
                )  # fmt: skip
                for i in range(2)
            ]
            first_record: list[float | None] = [None, None]
            while any(peer.running for peer in peers):
                for i, peer in enumerate(peers):
                    if first_record[i] is None and peer.records():
                        first_record[i] = time.monotonic() - started
                time.sleep(0.2)  # polling files the islands append to; nothing to await across processes
            status = boot.run(
                sys.executable, "-m", "p2p_diloco", "status", "--initial-peers", *swarm.maddrs,
                "--run-id", "internet", "--json", check=False,
            )  # fmt: skip
        finally:
            swarm.close()
    islands = []
    for i, peer in enumerate(peers):
        records = peer.records()
        log = peer.log_text()
        islands.append(
            {
                "exit_code": peer.process.returncode,
                "join_s": records[0].get("join_s") if records else None,
                "first_record_s": first_record[i],
                "round_s": statistics.mean(r["round_s"] for r in records[1:]) if len(records) > 1 else None,
                "merged_rounds": sum(r["partners"] > 0 for r in records),
                "rounds": len(records),
                "relayed": "using relay" in log,
                "final_eval": records[-1]["eval_loss"] if records else None,
            }
        )
    try:
        printed = json.loads(status.stdout)
    except json.JSONDecodeError:
        printed = {"error": status.stderr.strip()[-500:]}
    return {"relayed": relayed, "islands": islands, "status": printed}


def summary(result: dict) -> dict:
    """Means over the two islands of one setting."""
    islands = result["islands"]

    def mean(key: str) -> float | None:
        values = [island[key] for island in islands if island[key] is not None]
        return statistics.mean(values) if values else None

    return {key: mean(key) for key in ("join_s", "first_record_s", "round_s", "merged_rounds")}


def main(argv: list[str] | None = None) -> int:
    """Run both settings and write internet.json."""
    parser = benchmark_parser(__doc__, quick="4 outer steps per setting", smoke="3 outer steps (used by the tests)")
    args = parser.parse_args(argv)
    if (reason := available()) is not None:
        print(f"skipped: separate hosts need network namespaces ({reason})")
        return 0
    steps = STEPS["smoke" if args.smoke else "quick" if args.quick else "full"]
    runs = args.out / "internet-runs"
    results = {}
    for name, relayed in (("direct", False), ("relayed", True)):
        print(f"{name}: two islands, {steps} outer steps ...", flush=True)
        results[name] = setting(runs / name, relayed, steps)
        figures = summary(results[name])
        results[name]["summary"] = figures
        print(
            f"  join {figures['join_s']:.1f}s, first record after {figures['first_record_s']:.1f}s, "
            f"{figures['round_s']:.2f}s per round, {figures['merged_rounds']:.1f} merged rounds",
            flush=True,
        )
    direct, relayed = results["direct"]["summary"], results["relayed"]["summary"]
    ratios = {
        "join_relayed_over_direct": relayed["join_s"] / direct["join_s"],
        "round_relayed_over_direct": relayed["round_s"] / direct["round_s"],
    }
    print(
        f"relayed / direct: join x{ratios['join_relayed_over_direct']:.2f}, "
        f"seconds per round x{ratios['round_relayed_over_direct']:.2f}"
    )
    status = results["relayed"]["status"]
    for island in status.get("islands", []):
        print(
            f"  status: {island.get('peer_id', '?')[:16]}... {island.get('reachability')} step "
            f"{island.get('outer_step')} eval {island.get('eval_loss')}"
        )
    path = write_result(args.out, "internet", {**results, "ratios": ratios, **provenance("internet.py", argv)})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
