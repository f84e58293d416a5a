"""Goodput under failures: islands are SIGKILLed (and restarted) and SIGSTOPped on a seeded schedule.

The same schedule runs against p2p-diloco's default decoupled mode (quorum K=1, adaptive grace) and a
synchronous mode where every island waits for the whole swarm, each also once without faults. Reports
goodput (useful training tokens per second summed over islands, relative to the same mode without faults),
the final eval loss, the time from a restart to the restarted island's first merged round, and whether any
island exited with an error it should have survived.

    python benchmarks/chaos.py            # 5 islands, 90 s per run, 4 runs (about 7 minutes)
    python benchmarks/chaos.py --quick    # 4 islands, 60 s per run
    python benchmarks/chaos.py --smoke    # 3 islands, tiny model, short runs (used by the tests)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import machine

from p2p_diloco.cli.swarm import spawn, start_bootstrap, stop
from p2p_diloco.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MODES = {"decoupled": [], "synchronous": ["--quorum", "{n}", "--averaging-timeout", "60"]}


@dataclass
class Schedule:
    """Seeded fault schedule: (time, action, island) with action kill/restart/stop/cont."""

    events: list[tuple[float, str, int]] = field(default_factory=list)

    @classmethod
    def make(
        cls,
        *,
        seed: int,
        islands: int,
        budget: float,
        kill_every: float,
        restart_after: float,
        stop_every: float,
        stop_for: float,
    ) -> Schedule:
        rng = random.Random(seed)
        events = []
        down_until = [0.0] * islands
        t = kill_every
        while t + restart_after < budget - 5:
            victim = rng.choice([i for i in range(islands) if down_until[i] <= t])
            events += [(t, "kill", victim), (t + restart_after, "restart", victim)]
            down_until[victim] = t + restart_after
            t += kill_every
        t = stop_every / 2
        while t + stop_for < budget - 5:
            candidates = [i for i in range(islands) if down_until[i] <= t]
            if candidates:
                frozen = rng.choice(candidates)
                events += [(t, "stop", frozen), (t + stop_for, "cont", frozen)]
                down_until[frozen] = max(down_until[frozen], t + stop_for)
            t += stop_every
        return cls(sorted(events))


def run(
    mode: str, schedule: Schedule | None, *, islands: int, budget: float, inner_steps: int, tiny: bool, folder: Path
) -> dict:
    """One run of `budget` seconds; returns its measurements."""
    shutil.rmtree(folder, ignore_errors=True)  # an earlier run's checkpoints would be resumed from
    folder.mkdir(parents=True)
    bootstrap, maddrs = start_bootstrap(folder, run_id=f"chaos-{mode}")
    flags = [flag.format(n=islands) for flag in MODES[mode]]

    def start(index: int, remaining: float):
        args = [
            "peer",
            "--initial-peers",
            *maddrs,
            "--run-id",
            f"chaos-{mode}",
            "--shard-index",
            str(index),
            "--num-shards",
            str(islands),
            "--metrics",
            str(folder / f"island-{index}.jsonl"),
            "--checkpoint-dir",
            str(folder / f"island-{index}-ckpt"),
            "--outer-steps",
            "100000",
            "--time-budget-s",
            str(max(1.0, remaining)),
            "--inner-steps",
            str(inner_steps),
            "--target-group-size",
            str(islands),
            "--next-chunk-timeout",
            "3",
            "--batch-size",
            "8",
            *flags,
        ]
        if tiny:
            args += ["--config", str(REPO / "peers" / "tiny.toml")]
        return spawn(args, log_path=folder / f"island-{index}.log.{int(time.monotonic() * 1000)}")

    for index in range(islands):
        (folder / f"island-{index}.jsonl").unlink(missing_ok=True)
    started = time.monotonic()
    processes = {index: start(index, budget) for index in range(islands)}
    killed, restarts, kill_times = [], [], []
    try:
        for at, action, index in schedule.events if schedule else []:
            delay = started + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # the injector's clock: faults happen at scheduled times
            process = processes[index]
            if action == "kill" and process.poll() is None:
                process.send_signal(signal.SIGKILL)  # the island alone: its DHT and p2pd must follow it
                process.wait()
                killed.append(process)
                kill_times.append((index, time.time()))
            elif action == "restart":
                processes[index] = start(index, budget - (time.monotonic() - started))
                restarts.append((index, time.time()))
            elif action in ("stop", "cont") and process.poll() is None:
                os.killpg(process.pid, signal.SIGSTOP if action == "stop" else signal.SIGCONT)
        for process in processes.values():
            process.wait(timeout=max(30.0, budget - (time.monotonic() - started) + 120))
    finally:
        for process in processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGCONT)
            stop(process)
        stop(bootstrap)
    wall = time.monotonic() - started

    records = {index: read_metrics(folder / f"island-{index}.jsonl") for index in range(islands)}
    useful = 0
    for recs in records.values():
        previous = 0
        for record in recs:
            gained = record["tokens"] - previous
            previous = record["tokens"]
            if not (record.get("note") or "").count("stale"):
                useful += max(0, gained)
    recovery, killed_before_merging = [], 0
    for index, restarted_at in restarts:
        # Only this incarnation counts: an island killed again before it merged has no recovery time.
        next_kill = min((t for i, t in kill_times if i == index and t > restarted_at), default=float("inf"))
        merged_after = [r["time"] for r in records[index] if restarted_at < r["time"] < next_kill and r["partners"] > 0]
        if merged_after:
            recovery.append(merged_after[0] - restarted_at)
        elif next_kill < float("inf"):
            killed_before_merging += 1
        else:
            recovery.append(None)
    errors = [
        f"island-{index} exited {process.returncode}"
        for index, process in processes.items()
        if process.returncode not in (0,)
    ]
    # hivemind logs every failed round with a traceback; what counts is an island giving up with an error.
    fatal = sorted(
        f"{path.name}: {line.strip()}"
        for path in folder.glob("island-*.log.*")
        for line in path.read_text(errors="replace").splitlines()
        if line.startswith("p2p-diloco peer: error")
    )
    final = [recs[-1]["eval_loss"] for recs in records.values() if recs]
    return {
        "mode": mode,
        "faults": schedule is not None,
        "useful_tokens": useful,
        "goodput_tokens_per_s": useful / budget,
        "final_eval_loss": sum(final) / len(final) if final else None,
        "restart_to_first_merge_s": recovery,
        "restarts_killed_before_merging": killed_before_merging,
        "errors": errors + fatal,
        "kills": len(killed),
        "wall_s": wall,
    }


def plot(result: dict, path: Path) -> None:
    """Goodput and final eval loss per mode, with and without faults."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    labels = [f"{r['mode']}\n{'faults' if r['faults'] else 'no faults'}" for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].bar(range(len(runs)), [r["goodput_tokens_per_s"] for r in runs], color="tab:green")
    axes[0].set_title("goodput (useful tokens/s, all islands)")
    axes[1].bar(range(len(runs)), [r["final_eval_loss"] or 0 for r in runs], color="tab:blue")
    axes[1].set_title("final eval loss")
    for axis in axes:
        axis.set_xticks(range(len(runs)), labels, fontsize=8)
        axis.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Chaos: {result['islands']} islands, kills every {result['schedule']['kill_every']}s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    """Run both modes with and without the fault schedule; write chaos.json and chaos.png."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.smoke:
        islands, budget, kill_every, restart_after, stop_every, stop_for = 3, 26.0, 9.0, 4.0, 14.0, 4.0
    elif args.quick:
        islands, budget, kill_every, restart_after, stop_every, stop_for = 4, 60.0, 20.0, 8.0, 25.0, 6.0
    else:
        islands, budget, kill_every, restart_after, stop_every, stop_for = 5, 90.0, 30.0, 10.0, 40.0, 8.0
    schedule = Schedule.make(
        seed=args.seed,
        islands=islands,
        budget=budget,
        kill_every=kill_every,
        restart_after=restart_after,
        stop_every=stop_every,
        stop_for=stop_for,
    )
    print(f"fault schedule: {schedule.events}", flush=True)
    runs = []
    for mode in ("decoupled", "synchronous"):
        for faults in (False, True):
            label = f"{mode}-{'faults' if faults else 'clean'}"
            print(f"== {label}: {islands} islands, {budget:.0f}s", flush=True)
            row = run(
                mode,
                schedule if faults else None,
                islands=islands,
                budget=budget,
                inner_steps=10 if args.smoke else 20,
                tiny=args.smoke,
                folder=out / "chaos-runs" / label,
            )
            runs.append(row)
            print(
                f"   goodput {row['goodput_tokens_per_s']:.0f} tok/s  eval {row['final_eval_loss']}  "
                f"recovery {row['restart_to_first_merge_s']}  errors {row['errors']}",
                flush=True,
            )
    by = {(r["mode"], r["faults"]): r for r in runs}
    goodput = {
        mode: by[(mode, True)]["goodput_tokens_per_s"] / max(1e-9, by[(mode, False)]["goodput_tokens_per_s"])
        for mode in MODES
    }
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "islands": islands,
        "budget_s": budget,
        "schedule": {
            "seed": args.seed,
            "kill_every": kill_every,
            "restart_after": restart_after,
            "stop_every": stop_every,
            "stop_for": stop_for,
            "events": schedule.events,
        },
        "goodput": goodput,
        "final_eval_loss": {mode: by[(mode, True)]["final_eval_loss"] for mode in MODES},
        "restart_to_first_merge_s": {mode: by[(mode, True)]["restart_to_first_merge_s"] for mode in MODES},
        "restarts_killed_before_merging": {mode: by[(mode, True)]["restarts_killed_before_merging"] for mode in MODES},
        "unexpected_errors": {mode: by[(mode, True)]["errors"] + by[(mode, False)]["errors"] for mode in MODES},
        "runs": runs,
    }
    name = "chaos-smoke" if args.smoke else "chaos"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    plot(result, out / f"{name}.png")
    print(f"goodput relative to no faults: {goodput}")
    print(f"wrote {out / (name + '.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
