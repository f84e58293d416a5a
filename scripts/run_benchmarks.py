"""Runs every benchmark script one after another, showing progress and timing each (`make bench`, `make bench-quick`).

python scripts/run_benchmarks.py [--quick] [--all] [--out FOLDER] [--only NAME ...]

Writes `bench_times.json` into the result folder: `{mode, total_s, scripts: [{script, seconds, rc}]}`, so the
time `make bench` takes is measured, not guessed. Stops at the first script that fails, as make did.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SKIPPED = {"report.py"}
ON_REQUEST = {"attacks.py", "sparse_horizon.py"}
"""Run only with --all or --only: the attack table (23 swarms, about 11 minutes) measures defences, not speed or
quality, and changes only when they do; the top-k horizon (about 13 minutes) changes only with the codec.
BENCHMARKS.md keeps showing their last run, dated. --all also passes --extended to every script: the chaos
benchmark's standby mode and the bandwidth benchmark's fp16, bf16 and H = 50 rows (about 6 minutes), which a plain
run carries over from the last extended run, marked with its date."""


def scripts(only: list[str] | None, everything: bool = False) -> list[Path]:
    """The benchmark scripts in name order (with `everything`, also those run on request), or the named ones."""
    found = sorted(path for path in BENCHMARKS.glob("*.py") if path.name not in SKIPPED)
    if not only:
        return [path for path in found if everything or path.name not in ON_REQUEST]
    wanted = {name.removesuffix(".py") for name in only}
    unknown = wanted - {path.stem for path in found}
    if unknown:
        raise SystemExit(f"error: no benchmark named {', '.join(sorted(unknown))}; pick from the names in benchmarks/")
    return [path for path in found if path.stem in wanted]


def run(script: Path, quick: bool, out: Path | None, extended: bool = False) -> tuple[float, int]:
    """One benchmark as its own process; its wall time and exit code."""
    command = [sys.executable, str(script), *(["--quick"] if quick else []), *(["--out", str(out)] if out else [])]
    command += ["--extended"] if extended else []
    started = time.monotonic()
    rc = subprocess.call(command)
    return time.monotonic() - started, rc


def main(argv: list[str] | None = None) -> int:
    """Run them all, print a line per script and the total, and write bench_times.json."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="each script's --quick mode")
    parser.add_argument("--out", type=Path, default=None, help="result folder (default: benchmarks/results)")
    parser.add_argument(
        "--all",
        action="store_true",
        help=f"also {', '.join(sorted(ON_REQUEST))}, and every script --extended (make bench-all)",
    )
    parser.add_argument("--only", nargs="+", default=None, help="run only these benchmarks (names without .py)")
    args = parser.parse_args(argv)
    todo = scripts(args.only, args.all)
    times: list[dict] = []
    started = time.monotonic()
    for number, script in enumerate(todo, 1):
        print(f"[{number}/{len(todo)}] {script.name} ...", flush=True)
        seconds, rc = run(script, args.quick, args.out, args.all and not args.quick)
        times.append({"script": script.name, "seconds": round(seconds, 1), "rc": rc})
        print(f"[{number}/{len(todo)}] {script.name}: {seconds:.0f} s (total {time.monotonic() - started:.0f} s)")
        if rc != 0:
            break
    total = time.monotonic() - started
    folder = args.out or BENCHMARKS / "results"
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "mode": "quick" if args.quick else "all" if args.all else "full",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "total_s": round(total, 1),
        "scripts": times,
        "not_run": sorted(ON_REQUEST - {path.name for path in todo}),
    }
    if not args.only:
        (folder / "bench_times.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"{len(times)} benchmarks in {total / 60:.1f} min")
    return max((entry["rc"] for entry in times), default=0)


if __name__ == "__main__":
    raise SystemExit(main())
