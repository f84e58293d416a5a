"""A local swarm on 127.0.0.1: one bootstrap and N islands as separate processes, with progress and a summary."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from p2p_diloco.config import load_config
from p2p_diloco.process import die_with_parent, kill_process_tree
from p2p_diloco.train.metrics import read_metrics
from p2p_diloco.train.summary import format_summary, plot_losses, summarize

RUN_ID = "local-swarm"


def _child_setup() -> None:
    die_with_parent(signal.SIGTERM)


def spawn(
    args: list[str], log_path: Path | None = None, command_prefix: Sequence[str] = (), **kwargs
) -> subprocess.Popen:
    """Start `python -m p2p_diloco ARGS` in its own session, dying with this process.

    `command_prefix` wraps the command, e.g. `ip netns exec NS` to run it inside a network namespace.
    """
    stdout = open(log_path, "w") if log_path is not None else kwargs.pop("stdout", None)  # noqa: SIM115
    return subprocess.Popen(
        [*command_prefix, sys.executable, "-m", "p2p_diloco", *args],
        stdout=stdout,
        stderr=subprocess.STDOUT if log_path is not None else kwargs.pop("stderr", None),
        start_new_session=True,
        preexec_fn=_child_setup,
        **kwargs,
    )


def stop(process: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM a child (it shuts its own children down), then SIGKILL its whole session after `grace` seconds."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    kill_process_tree(process.pid)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def start_bootstrap(
    out: Path, run_id: str = RUN_ID, host: str = "127.0.0.1", command_prefix: Sequence[str] = ()
) -> tuple[subprocess.Popen, list[str]]:
    """Start a bootstrap listening on `host` and return it with its multiaddrs, read from its output."""
    process = spawn(
        [
            "bootstrap",
            "--host-maddrs",
            f"/ip4/{host}/tcp/0",
            "--run-id",
            run_id,
            "--maddrs-file",
            str(out / "bootstrap.maddrs"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        command_prefix=command_prefix,
    )
    return process, read_bootstrap_maddrs(process)


def read_bootstrap_maddrs(process: subprocess.Popen) -> list[str]:
    """The multiaddrs a starting bootstrap prints on its (text) stdout; stops it if it prints none."""
    maddrs = []
    for line in process.stdout:
        if line.startswith("MADDR "):
            maddrs.append(line.split()[1])
        if line.startswith("Start peers with"):
            break
    if not maddrs:
        stop(process)
        raise RuntimeError("the bootstrap exited before printing its multiaddrs")
    return maddrs


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
    out_dir.mkdir(parents=True, exist_ok=True)
    total_steps = outer_steps or load_config(config).train.outer_steps
    common = ["--config", config] if config else []
    if outer_steps:
        common += ["--outer-steps", str(outer_steps)]
    if inner_steps:
        common += ["--inner-steps", str(inner_steps)]
    common += ["--num-shards", str(peers), "--target-group-size", str(max(2, peers))]
    common += list(extra_peer_args or [])
    children: dict[str, subprocess.Popen] = {}
    metrics_paths: dict[str, Path] = {}
    bootstrap = None
    started = time.monotonic()
    try:
        bootstrap, maddrs = start_bootstrap(out_dir)
        print(f"bootstrap at {maddrs[0]}", flush=True)
        for index in range(peers):
            name = f"island-{index}"
            metrics_paths[name] = out_dir / f"{name}.jsonl"
            metrics_paths[name].unlink(missing_ok=True)
            children[name] = spawn(
                [
                    "peer",
                    "--initial-peers",
                    *maddrs,
                    "--run-id",
                    RUN_ID,
                    "--shard-index",
                    str(index),
                    "--metrics",
                    str(metrics_paths[name]),
                    *common,
                ],
                log_path=out_dir / f"{name}.log",
            )
        if baseline:
            name = "alone"
            metrics_paths[name] = out_dir / "alone.jsonl"
            metrics_paths[name].unlink(missing_ok=True)
            children[name] = spawn(
                [
                    "peer",
                    "--solo",
                    "true",
                    "--run-id",
                    "alone",
                    "--shard-index",
                    "0",
                    "--metrics",
                    str(metrics_paths[name]),
                    *common,
                ],
                log_path=out_dir / "alone.log",
            )
        print(f"started {peers} islands{' and one island alone' if baseline else ''}; logs in {out_dir}/")
        seen = {name: 0 for name in children}
        while True:
            for name, path in metrics_paths.items():
                records = read_metrics(path) if path.exists() else []
                for record in records[seen[name] :]:
                    _print_progress(name, record, total_steps)
                seen[name] = len(records)
            if all(child.poll() is not None for child in children.values()):
                break
            time.sleep(1.0)  # progress display cadence, not synchronisation
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every island", flush=True)
    finally:
        for child in children.values():
            stop(child)
        if bootstrap is not None:
            stop(bootstrap)

    metrics_by_island = {name: read_metrics(path) for name, path in metrics_paths.items() if path.exists()}
    summaries = summarize(metrics_by_island)
    print()
    print(format_summary(summaries))
    plot = plot_losses(metrics_by_island, out_dir / "loss.png", title=f"p2p-diloco: {peers} islands")
    codes = {name: child.returncode for name, child in children.items()}
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
