"""`p2p-diloco swarm`: a local swarm on 127.0.0.1, one bootstrap and N islands, with progress and a summary."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from p2p_diloco.cli.launcher import LocalSwarm
from p2p_diloco.config import load_config
from p2p_diloco.train.summary import format_summary, plot_losses, summarize

RUN_ID = "local-swarm"


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The `swarm` subcommand and its flags."""
    swarm = commands.add_parser("swarm", help="run a local swarm: a bootstrap and N islands on 127.0.0.1")
    swarm.add_argument("--peers", type=int, default=3, help="number of islands")
    swarm.add_argument("--config", help="TOML peer configuration shared by the islands")
    swarm.add_argument("--outer-steps", type=int, help="outer steps to run")
    swarm.add_argument("--inner-steps", type=int, help="inner steps per outer step")
    swarm.add_argument("--out", default="runs/swarm", help="folder for metrics, logs and the loss plot")
    swarm.add_argument("--baseline", action="store_true", help="also train one island alone, for comparison")
    swarm.add_argument("peer_args", nargs=argparse.REMAINDER, help="extra flags passed to every peer after --")


def run(args: argparse.Namespace) -> int:
    """Run the local swarm to completion (or Ctrl-C)."""
    # Ctrl-C must stop the swarm even when a shell started us with SIGINT ignored (a background job).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return run_local_swarm(
        peers=args.peers,
        config=args.config,
        outer_steps=args.outer_steps,
        inner_steps=args.inner_steps,
        out=args.out,
        baseline=args.baseline,
        extra_peer_args=[arg for arg in args.peer_args if arg != "--"],
    )


def _print_progress(name: str, record: dict, outer_steps: int | None) -> None:
    total = f"/{outer_steps}" if outer_steps else ""
    eval_loss = record.get("eval_loss")
    print(
        f"[{name}] outer step {record['outer_step']}{total}  loss {record['loss']:.4f}  "
        f"eval {eval_loss if eval_loss is None else f'{eval_loss:.4f}'}  partners {record['partners']}  "
        f"wait {record['wait_s']:.2f}s",
        flush=True,
    )


def run_local_swarm(
    *,
    peers: int,
    config: str | None,
    outer_steps: int | None,
    inner_steps: int | None,
    out: str,
    baseline: bool = False,
    extra_peer_args: list[str] | None = None,
) -> int:
    """Run the swarm to completion (or Ctrl-C), print a per-island summary and write metrics and a loss plot."""
    out_dir = Path(out)
    total_steps = outer_steps or load_config(config).train.outer_steps
    common = ["--config", config] if config else []
    if outer_steps:
        common += ["--outer-steps", str(outer_steps)]
    if inner_steps:
        common += ["--inner-steps", str(inner_steps)]
    common += ["--num-shards", str(peers), "--target-group-size", str(max(2, peers))]
    common += list(extra_peer_args or [])
    swarm = LocalSwarm(out_dir, run_id=RUN_ID)
    started = time.monotonic()
    try:
        maddrs = swarm.bootstrap()
        print(f"bootstrap at {maddrs[0]}", flush=True)
        for index in range(peers):
            swarm.peer(f"island-{index}", "--shard-index", str(index), *common, fresh_metrics=True, checkpoints=False)
        if baseline:
            solo = ["--solo", "true", "--run-id", "alone", "--shard-index", "0"]
            swarm.peer("alone", *solo, *common, join=False, fresh_metrics=True, checkpoints=False)
        print(f"started {peers} islands{' and one island alone' if baseline else ''}; logs in {out_dir}/")
        seen = {name: 0 for name in swarm.peers}
        while True:
            for name, records in swarm.records().items():
                for record in records[seen[name] :]:
                    _print_progress(name, record, total_steps)
                seen[name] = len(records)
            if not any(peer.running for peer in swarm.peers.values()):
                break
            time.sleep(1.0)  # progress display cadence, not synchronisation
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every island", flush=True)
    finally:
        swarm.close()

    return _report(swarm, out_dir, peers, started)


def _report(swarm: LocalSwarm, out_dir: Path, peers: int, started: float) -> int:
    """Print the per-island summary, write summary.json and the loss plot; 1 if an island failed."""
    metrics_by_island = swarm.records()
    summaries = summarize(metrics_by_island)
    print()
    print(format_summary(summaries))
    plot = plot_losses(metrics_by_island, out_dir / "loss.png", title=f"p2p-diloco: {peers} islands")
    codes = {name: peer.process.returncode for name, peer in swarm.peers.items()}
    summary = {
        "peers": peers,
        "wall_s": time.monotonic() - started,
        "exit_codes": codes,
        "islands": [summary.__dict__ for summary in summaries],
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\nwall time {summary['wall_s']:.0f}s; loss plot {plot}; metrics in {out_dir}/")
    failed = {name: code for name, code in codes.items() if code != 0}
    if failed:
        print(f"islands that failed: {failed} (see their .log files)", file=sys.stderr)
        return 1
    return 0
