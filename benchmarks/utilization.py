"""Compute utilization on a slow link: blocking DiLoCo vs Streaming DiLoCo with overlapped exchange.

Two islands, each in its own network namespace, joined by a veth pair whose both ends are shaped with `tc`
(token bucket at --rate-mbit; netem delay of --delay-ms where the kernel has netem). The script creates the
namespaces and removes them, also on failure; nothing but the veth pair carries the islands' traffic. Where
network namespaces are not permitted it says so and falls back to an in-process limiter that paces every byte
the all-reduce sends (P2P_DILOCO_LINK_MBIT), on 127.0.0.1.

Both modes train the same number of tokens: blocking is P = 1, τ = 0 (training stops for every exchange);
streaming is P fragments with overlap τ (the exchange of a fragment runs while training goes on). Reported:
compute_fraction = inner-step time / (wall-clock minus evaluation time), per island, averaged.

    sudo python benchmarks/utilization.py          # default model, H = 100 (about 3 minutes on 2 cores)
    python benchmarks/utilization.py --quick       # default model, H = 100, 2 full-model syncs
    python benchmarks/utilization.py --smoke       # tiny model, 2 + 4 outer steps (used by the tests)
    python benchmarks/utilization.py --link limiter  # skip namespaces
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from lib.common import TINY, benchmark_parser, provenance, run_islands, write_result

SUBNET = "10.231.{}.{}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def netns_permitted() -> tuple[bool, str]:
    """Whether this process may create network namespaces and veth pairs (and why not)."""
    probe = f"p2pdu-probe-{os.getpid()}"
    try:
        result = _ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return False, "the `ip` command is not installed"
    if result.returncode != 0:
        return False, result.stderr.strip() or "ip netns add failed"
    _ip("netns", "del", probe, check=False)
    return True, ""


@contextlib.contextmanager
def namespaces(count: int, rate_mbit: float, delay_ms: float) -> Iterator[dict]:
    """`count` namespaces on one bridge-less star: namespace 0 holds the bootstrap; veth pairs to each other one.

    For two islands this is a single veth pair. Every veth end is shaped to `rate_mbit` (and `delay_ms` with
    netem when available). Yields what was set up; removes every namespace on exit.
    """
    tag = os.getpid() % 100000
    names = [f"p2pdu-{tag}-{i}" for i in range(count)]
    link = {"names": names, "hosts": {}, "shaping": []}
    created: list[str] = []
    try:
        for name in names:
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
        link["hosts"][0] = SUBNET.format(1, 1)
        for index in range(1, count):
            hub_end, leaf_end = f"vh{tag}x{index}", f"vl{tag}x{index}"
            created.append(hub_end)
            _ip("link", "add", hub_end, "type", "veth", "peer", "name", leaf_end)
            _ip("link", "set", hub_end, "netns", names[0])
            _ip("link", "set", leaf_end, "netns", names[index])
            hub_ip, leaf_ip = SUBNET.format(index, 1), SUBNET.format(index, 2)
            _ip("-n", names[0], "addr", "add", f"{hub_ip}/24", "dev", hub_end)
            _ip("-n", names[index], "addr", "add", f"{leaf_ip}/24", "dev", leaf_end)
            for ns, dev in ((names[0], hub_end), (names[index], leaf_end)):
                _ip("-n", ns, "link", "set", dev, "up")
                link["shaping"].append(shape(ns, dev, rate_mbit, delay_ms))
            # leaves reach the hub's other subnets through it
            _ip("-n", names[index], "route", "add", "default", "via", hub_ip)
            link["hosts"][index] = leaf_ip
        _ip("netns", "exec", names[0], "sysctl", "-qw", "net.ipv4.ip_forward=1", check=False)
        yield link
    finally:
        for name in names:
            _ip("netns", "del", name, check=False)
        for device in created:  # only left in the root namespace if setup failed before moving it
            _ip("link", "del", device, check=False)


def shape(namespace: str, device: str, rate_mbit: float, delay_ms: float) -> str:
    """Shape one veth end: netem (delay + rate) if the kernel has it, else a token bucket; returns what was used."""
    base = ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root"]
    if delay_ms > 0:
        netem = subprocess.run(
            [*base, "netem", "delay", f"{delay_ms}ms", "rate", f"{rate_mbit}mbit", "limit", "100000"],
            capture_output=True,
            text=True,
        )
        if netem.returncode == 0:
            return f"netem delay {delay_ms}ms rate {rate_mbit}mbit"
    burst = max(32_000, int(rate_mbit * 1e6 / 8 / 250))  # at least one 4 ms timer tick of data
    subprocess.run([*base, "tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "200ms"], check=True)
    return f"tbf rate {rate_mbit}mbit (netem delay unavailable)" if delay_ms > 0 else f"tbf rate {rate_mbit}mbit"


def compute_fraction(records: list[dict]) -> float | None:
    """Inner-step seconds over wall-clock seconds (evaluation excluded) from an island's first to last record."""
    if not records:
        return None
    start = records[0]["time"] - records[0]["round_s"]
    wall = records[-1]["time"] - start - sum(r.get("eval_s") or 0.0 for r in records)
    return sum(r["compute_s"] for r in records) / wall if wall > 0 else None


def run_mode(name: str, flags: list[str], args: argparse.Namespace, link: dict | None, out: Path) -> dict:
    """One swarm of two islands in one mode; returns its row."""
    common = ["--inner-steps", str(args.inner_steps), "--num-shards", "2", "--quorum", "2"]
    common += ["--target-group-size", "2", "--averaging-timeout", "120", "--eval-batches", "4", "--batch-size", "8"]
    # Matchmaking takes at least min_matchmaking_time: keep it inside the overlap window of the streaming mode.
    common += ["--min-matchmaking-time", "0.5", "--request-timeout", "0.4"]
    if args.tiny:
        common += ["--config", str(TINY)]
    prefix = host = None
    environment = {}
    if link is not None:
        names, hosts = link["names"], link["hosts"]
        prefix = lambda index: ["ip", "netns", "exec", names[0 if index is None else index]]  # noqa: E731
        host = lambda index: hosts[0 if index is None else index]  # noqa: E731
    else:
        environment["P2P_DILOCO_LINK_MBIT"] = str(args.rate_mbit)
    previous = {key: os.environ.get(key) for key in environment}
    os.environ.update(environment)
    try:
        records, exit_codes, wall = run_islands(
            out / f"utilization-{name}",
            f"utilization-{name}",
            2,
            common + flags,
            per_island=lambda index: ["--shard-index", str(index)],
            command_prefix=prefix,
            host=host,
            timeout=args.timeout,
        )
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    fractions = {island: compute_fraction(recs) for island, recs in records.items()}
    known = [f for f in fractions.values() if f is not None]
    row = {
        "mode": name,
        "flags": flags,
        "compute_fraction": sum(known) / len(known) if known else None,
        "compute_fraction_per_island": fractions,
        "wait_s": {island: sum(r["wait_s"] for r in recs) for island, recs in records.items()},
        "exchange_s": {island: sum(r.get("exchange_s") or 0.0 for r in recs) for island, recs in records.items()},
        "merged_rounds": {island: sum(1 for r in recs if r["merged"]) for island, recs in records.items()},
        "final_eval_loss": {island: (recs[-1]["eval_loss"] if recs else None) for island, recs in records.items()},
        "tokens": {island: (recs[-1]["tokens"] if recs else 0) for island, recs in records.items()},
        "exit_codes": exit_codes,
        "wall_s": wall,
    }
    print(
        f"{name:<10} compute fraction {row['compute_fraction'] or 0:.3f}  waited "
        f"{sum(row['wait_s'].values()) / 2:.1f}s per island  merged {row['merged_rounds']}  {wall:.0f}s",
        flush=True,
    )
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags, plus the mode's model size (`tiny`), H (`inner_steps`) and full-model syncs (`syncs`)."""
    parser = benchmark_parser(
        __doc__,
        quick="default model, 2 full-model syncs per mode",
        smoke="tiny model, very few steps (used by the tests)",
    )
    parser.add_argument("--link", choices=["auto", "netns", "limiter"], default="auto")
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--delay-ms", type=float, default=50.0, help="needs netem; reported when unavailable")
    parser.add_argument("--fragments", type=int, default=2, help="P of the streaming mode")
    parser.add_argument("--overlap-steps", type=int, default=None, help="τ of the streaming mode (default H/P)")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    args.tiny, args.inner_steps, args.syncs = False, 100, 4
    if args.quick:
        args.tiny, args.inner_steps, args.syncs = False, 100, 2
    if args.smoke:
        args.tiny, args.inner_steps, args.syncs = True, 10, 2
    return args


def run_modes(args: argparse.Namespace, tau: int, use_netns: bool) -> tuple[list[dict], list[str]]:
    """Blocking, then streaming, each in fresh namespaces (or on the limiter); the rows and the link shaping."""
    modes = [
        ("blocking", ["--outer-steps", str(args.syncs), "--fragments", "1", "--overlap-steps", "0"]),
        (
            "streaming",
            ["--outer-steps", str(args.syncs * args.fragments), "--fragments", str(args.fragments)]
            + ["--overlap-steps", str(tau)],
        ),
    ]
    runs = args.out / "utilization-runs"
    rows, shaping = [], []
    for name, flags in modes:
        if use_netns:
            with namespaces(2, args.rate_mbit, args.delay_ms) as link:
                shaping = link["shaping"]
                rows.append(run_mode(name, flags, args, link, runs))
        else:
            rows.append(run_mode(name, flags, args, None, runs))
    return rows, shaping


def main(argv: list[str] | None = None) -> int:
    """Blocking vs streaming on a shaped link; writes utilization.json and utilization.png."""
    args = parse_args(argv)
    tau = args.overlap_steps if args.overlap_steps is not None else args.inner_steps // args.fragments
    reason = ""
    if args.link in ("auto", "netns"):
        permitted, reason = netns_permitted()
        if not permitted:
            print(f"network namespaces are not permitted here ({reason}); using the in-process limiter", flush=True)
            if args.link == "netns":
                return 2
    use_netns = args.link != "limiter" and not reason
    rows, shaping = run_modes(args, tau, use_netns)
    by_mode = {row["mode"]: row for row in rows}
    result = {
        "link": "netns" if use_netns else "limiter",
        "compute_fraction": {mode: row["compute_fraction"] for mode, row in by_mode.items()},
        "link_setup": shaping if use_netns else f"P2P_DILOCO_LINK_MBIT={args.rate_mbit} (payload only)",
        "netns_unavailable_reason": reason or None,
        "rate_mbit": args.rate_mbit,
        "delay_ms_requested": args.delay_ms,
        "H": args.inner_steps,
        "fragments": args.fragments,
        "overlap_steps": tau,
        "full_model_syncs": args.syncs,
        "target": {"streaming": 0.95},
        "rows": rows,
        **provenance("utilization.py", argv),
    }
    name = "utilization-smoke" if args.smoke else "utilization"
    path = write_result(args.out, name, result)
    plot(rows, args.out / f"{name}.png")
    print(f"link {result['link']}: {shaping or result['link_setup']}")
    print(f"wrote {path} and {name}.png")
    return 1 if any(code != 0 for row in rows for code in row["exit_codes"]) else 0


def plot(rows: list[dict], path: Path) -> None:
    """Compute fraction per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5, 4))
    axis.bar([row["mode"] for row in rows], [row["compute_fraction"] or 0 for row in rows], color=["#999", "#2a7"])
    axis.axhline(0.95, linestyle="--", color="k", linewidth=1, label="target 0.95")
    axis.set_ylim(0, 1.05)
    axis.set_ylabel("fraction of wall-clock spent computing")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
