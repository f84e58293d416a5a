"""What every benchmark records about the machine it ran on."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from pathlib import Path


def machine() -> dict:
    """Platform, Python, torch, CPU count and memory: enough to tell two result files' machines apart."""
    import psutil
    import torch

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 1e9, 1),
    }


def provenance(script: str, argv: list[str] | None) -> dict:
    """The command, date and machine that every result file records."""
    import datetime
    import sys

    arguments = argv if argv is not None else sys.argv[1:]
    return {
        "command": f"python benchmarks/{script}" + "".join(f" {a}" for a in arguments),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
    }


def run_islands(
    folder: Path,
    run_id: str,
    count: int,
    flags: list[str],
    *,
    per_island: Callable[[int], list[str]] | None = None,
    command_prefix: Callable[[int | None], list[str]] | None = None,
    host: Callable[[int | None], str] | None = None,
    timeout: float = 900.0,
) -> tuple[dict[str, list[dict]], list[int | None], float]:
    """A bootstrap and `count` islands of one run until they all exit; returns their records, exit codes, wall s.

    Island i gets `flags` plus `per_island(i)`; `command_prefix(i)` and `host(i)` place it (None: the bootstrap),
    e.g. in a network namespace. Every child is stopped, even when this fails.
    """
    import time

    from p2p_diloco.cli.swarm import spawn, start_bootstrap, stop
    from p2p_diloco.train.metrics import read_metrics

    prefix = command_prefix or (lambda index: [])
    address = host or (lambda index: "127.0.0.1")
    folder.mkdir(parents=True, exist_ok=True)
    bootstrap, maddrs = start_bootstrap(folder, run_id=run_id, host=address(None), command_prefix=prefix(None))
    children = []
    started = time.monotonic()
    try:
        for index in range(count):
            metrics = folder / f"island-{index}.jsonl"
            metrics.unlink(missing_ok=True)
            args = ["peer", "--initial-peers", *maddrs, "--run-id", run_id, "--metrics", str(metrics)]
            args += ["--host-maddrs", f"/ip4/{address(index)}/tcp/0", *flags]
            args += per_island(index) if per_island else []
            children.append(spawn(args, log_path=folder / f"island-{index}.log", command_prefix=prefix(index)))
        deadline = started + timeout
        for child in children:
            child.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for child in children:
            stop(child)
        stop(bootstrap)
    records = {f"island-{i}": read_metrics(folder / f"island-{i}.jsonl") for i in range(count)}
    return records, [child.returncode for child in children], time.monotonic() - started
