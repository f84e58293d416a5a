"""What every benchmark shares: where results go, the flags every script takes, what a result file records,
and a local swarm of islands (p2p_diloco.cli.launcher.LocalSwarm) run until every island exits."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
REPO = BENCHMARKS.parent
RESULTS = BENCHMARKS / "results"
QUICK_RESULTS = REPO / "runs" / "bench-quick"
"""Where --quick writes unless --out says otherwise: a quick run's figures never replace the committed ones."""
TINY = REPO / "peers" / "tiny.toml"


class _BenchmarkParser(argparse.ArgumentParser):
    """An ArgumentParser whose --out defaults to RESULTS, or to QUICK_RESULTS with --quick."""

    def parse_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201 - argparse's own signature
        parsed = super().parse_args(args, namespace)
        if parsed.out is None:
            parsed.out = QUICK_RESULTS if parsed.quick else RESULTS
        return parsed


def benchmark_parser(
    doc: str | None,
    *,
    quick: str | None = None,
    smoke: str | None = "tiny model, a few steps (used by the tests)",
    out: str = "folder for the JSON, the PNG and run logs",
    extended: str | None = None,
) -> argparse.ArgumentParser:
    """The parser every benchmark extends: --quick, --smoke (unless `smoke` is None), --out (a Path) and
    --extended (what `make bench-all` adds; accepted by every benchmark, a no-op where `extended` is None)."""
    parser = _BenchmarkParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument(
        "--extended",
        action="store_true",
        help=extended or "no effect here (make bench-all passes it to every benchmark)",
    )
    if smoke is not None:
        parser.add_argument("--smoke", action="store_true", help=smoke)
    where = "default: benchmarks/results; with --quick runs/bench-quick, as make bench-quick"
    parser.add_argument("--out", type=Path, default=None, help=f"{out} ({where})")
    return parser


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


def write_result(out: Path, name: str, result: dict) -> Path:
    """Write `result` to OUT/NAME.json and return that path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


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

    Island i (named island-i, fresh metrics, no checkpoints) gets `flags` plus `per_island(i)`; `command_prefix(i)`
    and `host(i)` place it (None: the bootstrap), e.g. in a network namespace. Every child is stopped, even when
    this fails; islands still running after `timeout` seconds raise TimeoutError.
    """
    from p2p_diloco.cli.launcher import LocalSwarm

    prefix = command_prefix or (lambda index: [])
    address = host or (lambda index: "127.0.0.1")
    swarm = LocalSwarm(folder, run_id=run_id)
    try:
        swarm.bootstrap(host=address(None), command_prefix=prefix(None))
        started = time.monotonic()
        for index in range(count):
            args = ["--host-maddrs", f"/ip4/{address(index)}/tcp/0", *flags, *(per_island(index) if per_island else [])]
            swarm.peer(f"island-{index}", *args, command_prefix=prefix(index), fresh_metrics=True, checkpoints=False)
        codes = swarm.wait(timeout)
        if None in codes.values():
            running = [name for name, code in codes.items() if code is None]
            raise TimeoutError(f"{', '.join(running)} of {run_id} still running after {timeout:.0f}s")
    finally:
        swarm.close()
    return swarm.records(), list(codes.values()), time.monotonic() - started
