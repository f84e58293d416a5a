"""`p2p-diloco status` (a run's islands) and `p2p-diloco swarms` (the known swarms and the runs of a DHT)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from p2p_diloco.cli.logs import setup_logging
from p2p_diloco.config import NetworkConfig
from p2p_diloco.errors import UserError


def add_swarm_flags(parser: argparse.ArgumentParser, run_id: bool = True) -> None:
    """--initial-peers (or --swarm NAME from the list of known swarms) and, if `run_id`, --run-id."""
    parser.add_argument("--initial-peers", nargs="+", metavar="MADDR", help="a bootstrap or live peer of the swarm")
    parser.add_argument("--swarm", help="a swarm of the list of known swarms, instead of --initial-peers/--run-id")
    parser.add_argument(
        "--swarms-file",
        help="the list of known swarms (default: $P2P_DILOCO_SWARMS, then "
        "./bootstrap/swarms.toml, then the list that ships)",
    )
    if run_id:
        parser.add_argument("--run-id", help="the run to show")
    parser.add_argument("--join-timeout", type=float, default=30.0, help="seconds to reach the swarm (default 30)")
    parser.add_argument("--swarm-public-key", help="a private swarm's owner public key (then --membership too)")
    parser.add_argument("--membership", help="a membership token of the private swarm (issued for --identity)")
    parser.add_argument("--identity", help="the identity file the token was issued for")
    parser.add_argument("--log-level", default="WARNING", help="p2p-diloco's log level (default WARNING)")


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The `status` and `swarms` subcommands."""
    status = commands.add_parser("status", help="show the islands of a run: steps, losses, reachability, partners")
    add_swarm_flags(status)
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument("--watch", action="store_true", help="print again every --interval seconds until Ctrl-C")
    status.add_argument("--interval", type=float, default=5.0, help="seconds between --watch refreshes (default 5)")
    swarms = commands.add_parser("swarms", help="list the known swarms, and with --initial-peers the runs of a DHT")
    add_swarm_flags(swarms, run_id=False)
    swarms.add_argument("--json", action="store_true", help="print JSON instead of a table")


def target(args: argparse.Namespace, need_run: bool = True) -> tuple[list[str], str | None]:
    """The initial peers and run id from the flags or from a named swarm."""
    from p2p_diloco.cli.known_swarms import resolve_swarm, swarms_file
    from p2p_diloco.net.maddrs import validate_maddrs

    peers, run_id = list(args.initial_peers or []), getattr(args, "run_id", None)
    if args.swarm:
        overrides, _ = resolve_swarm(args.swarm, swarms_file(args.swarms_file))
        peers = peers or overrides["network.initial_peers"]
        run_id = run_id or overrides["network.run_id"]
    if not peers:
        raise UserError("pass --initial-peers MADDR (a bootstrap or live peer) or --swarm NAME")
    if need_run and not run_id:
        raise UserError("pass --run-id RUN (or --swarm NAME); `p2p-diloco swarms --initial-peers ...` lists the runs")
    return validate_maddrs(peers, need_peer_id=True), run_id


def observer_membership(args: argparse.Namespace) -> Any:
    """The membership a reader of a private swarm shows (None for a public swarm)."""
    if not args.swarm_public_key:
        return None
    from p2p_diloco.net.identity import ensure_identity, peer_id_of_identity
    from p2p_diloco.net.membership import load_membership

    args.identity = ensure_identity(args.identity)
    peer = peer_id_of_identity(args.identity)
    return load_membership(args.swarm_public_key, args.membership, None, peer, getattr(args, "run_id", None))


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def status_table(summary: dict[str, Any]) -> str:
    """The islands of a run as an aligned text table, with the swarm's clock and tokens on top."""
    header = ["island", "reach", "step", "loss", "eval", "tok/s", "partners", "codec", "version", "seen"]
    rows = [
        [
            row["peer_id"][-12:],
            _fmt(row["reachability"]),
            str(row["outer_step"]),
            _fmt(row["loss"]),
            _fmt(row["eval_loss"]),
            _fmt(row["tokens_per_s"], 0),
            _fmt(None if row["partners"] is None else int(row["partners"])),
            _fmt(row["codec"]),
            _fmt(row["version"]),
            f"{row['last_seen_s']:.0f}s ago",
        ]
        for row in summary["islands"]
    ]
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in [header, *rows]]
    top = (
        f"run {summary['run_id']}: {len(rows)} islands, swarm clock {summary['clock']}, "
        f"{summary['total_tokens']:,} tokens"
    )
    return "\n".join([top, *lines])


def run_status(args: argparse.Namespace) -> int:
    """Print the run's islands once, or again and again with --watch."""
    from p2p_diloco.net.observer import Observer, summary

    try:
        peers, run_id = target(args)
        setup_logging(args.log_level)
        ttl = NetworkConfig().announce_ttl
        with Observer(
            peers, timeout=args.join_timeout, membership=observer_membership(args), identity=args.identity
        ) as observer:
            while True:
                report = summary(run_id, observer.islands(run_id), ttl)
                print(json.dumps(report) if args.json else status_table(report), flush=True)
                if not args.watch:
                    return 0 if report["islands"] else 1
                time.sleep(args.interval)  # the refresh cadence the user asked for
    except UserError as error:
        print(f"p2p-diloco status: error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        return 130


def run_swarms(args: argparse.Namespace) -> int:
    """Print the list of known swarms, and with --initial-peers (or --swarm) the runs the DHT knows."""
    from p2p_diloco.cli.known_swarms import describe, swarms_file

    try:
        path = swarms_file(args.swarms_file)
        listed = describe(path) if path.is_file() else []
        runs = None
        if args.initial_peers or args.swarm:
            from p2p_diloco.net.observer import Observer

            peers, _ = target(args, need_run=False)
            setup_logging(args.log_level)
            with Observer(
                peers, timeout=args.join_timeout, membership=observer_membership(args), identity=args.identity
            ) as observer:
                runs = observer.runs()
    except UserError as error:
        print(f"p2p-diloco swarms: error: {error}", file=sys.stderr)
        return error.exit_code
    if args.json:
        print(json.dumps({"swarms_file": str(path), "swarms": listed, "runs": runs}))
        return 0
    print(f"known swarms ({path}):" if listed else f"no known swarms in {path}")
    for row in listed:
        print(f"  {row['name']}: run {row['run_id']}, {row['initial_peers']} initial peers  {row['description']}")
    if runs is not None:
        print("runs in the DHT:" if runs else "no runs in the DHT")
        for run_id, info in sorted(runs.items()):
            print(
                f"  {run_id}: {info.get('islands')} islands, outer step {info.get('outer_step')}, "
                f"codec {info.get('codec')}, model {info.get('fingerprint')}"
            )
    return 0


def run(args: argparse.Namespace) -> int:
    """Dispatch `status` and `swarms`."""
    return run_status(args) if args.command == "status" else run_swarms(args)
