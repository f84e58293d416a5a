"""The quality benchmark's data-parallel system: 4 gloo ranks of lib/dp_rank.py, gradients all-reduced every step,
rank 0 evaluating every H steps; what they imported is recorded so that a later run can carry the result over."""

from __future__ import annotations

import datetime
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from lib.common import BENCHMARKS
from lib.quality_common import ISLANDS, Progress, check_codes, read_jsonl, timeout_for
from lib.source_digest import source_digest


def _with_benchmarks_on_path(environment: dict[str, str]) -> dict[str, str]:
    """`environment` with benchmarks/ first on PYTHONPATH, so that `python -m lib.dp_rank` runs from any folder (an
    empty entry would put the working folder on the ranks' path)."""
    path = [str(BENCHMARKS), *filter(None, environment.get("PYTHONPATH", "").split(os.pathsep))]
    return {**environment, "PYTHONPATH": os.pathsep.join(path)}


def _start_ranks(
    settings: dict, store: Path, metrics: Path, logs: list[Path], children: list[subprocess.Popen]
) -> None:
    """Start the ranks into `children`, each in its own session and dying with this process."""
    from p2p_diloco.process import die_with_parent

    for rank in range(ISLANDS):
        command = [sys.executable, "-m", "lib.dp_rank", "--rank", str(rank)]
        command += ["--rendezvous", store.resolve().as_uri(), "--settings", json.dumps(settings)]
        command += ["--metrics", str(metrics.resolve())]
        with open(logs[rank], "w") as log:
            children.append(
                subprocess.Popen(
                    command,
                    env=_with_benchmarks_on_path(dict(os.environ)),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=functools.partial(die_with_parent, signal.SIGTERM),
                )
            )


def run_data_parallel(settings: dict, folder: Path) -> dict:
    """(a): 4 gloo ranks of lib/dp_rank.py."""
    from p2p_diloco.cli.launcher import stop

    folder.mkdir(parents=True, exist_ok=True)
    metrics = folder / "rank-0.jsonl"
    metrics.unlink(missing_ok=True)
    # A file rendezvous needs no free port (a port picked here could be taken before rank 0 binds it)
    store = folder / "rendezvous"
    store.unlink(missing_ok=True)
    logs = [folder / f"rank-{rank}.log" for rank in range(ISLANDS)]
    children: list[subprocess.Popen] = []
    started = time.monotonic()
    try:
        _start_ranks(settings, store, metrics, logs, children)
        progress = Progress({"data_parallel": metrics}, settings["outer_steps"])
        codes = progress.follow(children, timeout_for(settings), "data-parallel training")
    finally:
        for child in children:
            stop(child, grace=10)
        store.unlink(missing_ok=True)
    wall = time.monotonic() - started
    records = read_jsonl(metrics)
    finished = any("replica_max_abs_diff" in r for r in records)
    if not finished:  # a rank that fails after the last all-reduce (teardown) does not void the results
        check_codes(codes, "data-parallel training", logs)
    if any(codes):
        print(f"  warning: data-parallel ranks exited with {codes} after finishing training", flush=True)
    evals = [r for r in records if "eval_loss" in r]
    last = next((r for r in records if "replica_max_abs_diff" in r), {})
    sources = last.get("sources", [])
    return {
        "curve": {
            "tokens": [r["tokens"] for r in evals],
            "eval_loss": [r["eval_loss"] for r in evals],
            "inner_steps": [r["step"] for r in evals],
        },
        "final_eval_loss": evals[-1]["eval_loss"],
        "total_tokens": evals[-1]["tokens"],
        "steps": evals[-1]["step"],
        "replica_max_abs_diff": last.get("replica_max_abs_diff"),
        "exit_codes": codes,
        "wall_s": wall,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "sources": sources,
        "source_digest": source_digest(sources) if sources else None,
    }
