"""Where a restarted island's time goes beside one other island, and what the start-up shortcuts save.

The chaos benchmark restarts islands beside four busy ones on 2 cores, so its restart breakdown measures CPU
contention as much as p2p-diloco. Here two islands train; island 1 is SIGKILLed (with its DHT and p2pd) after a
merged round and started again at once, 3 times each way (--quick: 1), alternating three ways of starting:

    shipped   modules hivemind imports but never runs (scipy.optimize) execute late, and the DHT node is
              launched before the model is built (`p2p_diloco.quick_start`)
    plain     `P2P_DILOCO_PLAIN_START=1`: everything imported up front, the DHT joined after the model is built
    standby   a standby (`--standby true`, same flags and checkpoint folder) started before the kill, its
              interpreter, imports, model and data ready: it takes the folder over when the island dies, so the
              restart is counted from the kill

Each restart's first metrics record names its start-up phases (process_start_s: interpreter, imports, model,
data; join_s: DHT, reachability, announcement, averager; restore_s: checkpoint and the swarm's state, download
included); first_round_s is the rest until its first merged round. The ratio the issue asks about is
restart-to-first-merge over the state transfer (restore_s). A fresh interpreter's import of the island
(`import p2p_diloco.island.island`) is timed both ways too, 5 times each (--quick: 1), alternating.

    python benchmarks/restart.py            # default model, 3 restarts each way, 5 imports each way (~3 min)
    python benchmarks/restart.py --quick    # default model, 1 restart and 1 import each way
    python benchmarks/restart.py --smoke    # tiny model, 1 restart each way, 1 import each way (used by the tests)
"""

from __future__ import annotations

import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from lib.common import TINY, benchmark_parser, provenance, write_result

from p2p_diloco.cli.launcher import LocalSwarm

WAYS = {"shipped": (), "plain": ("env", "P2P_DILOCO_PLAIN_START=1"), "standby": ()}
IMPORT_WAYS = ("shipped", "plain")  # a standby imports before the kill: nothing of its imports is in its restart
PHASES = ("process_start_s", "join_s", "restore_s", "first_round_s")
MERGE_WAIT_S = 120.0  # a healthy restart merges within seconds; this bounds a broken one
POLL_S = 0.2
FLAGS = ["--num-shards", "2", "--outer-steps", "100000", "--inner-steps", "10", "--batch-size", "8"]
FLAGS += ["--target-group-size", "2", "--next-chunk-timeout", "3"]


def import_seconds(way: str) -> float:
    """Wall seconds of a fresh interpreter importing the island module, started `way`."""
    command = [*WAYS[way], sys.executable, "-c", "import p2p_diloco.island.island, p2p_diloco.cli.main"]
    started = time.perf_counter()
    subprocess.run(command, check=True)
    return time.perf_counter() - started


def first_merge_after(swarm: LocalSwarm, name: str, after: float) -> tuple[dict, dict]:
    """The peer's first record written after wall time `after` (its start-up phases) and its first merged one."""
    deadline = time.monotonic() + MERGE_WAIT_S
    while time.monotonic() < deadline:
        peer = swarm.peers[name]
        if not peer.running:
            raise RuntimeError(f"{name} exited {peer.process.returncode}; log tail:\n{peer.log_text()[-2000:]}")
        records = [r for r in peer.records() if r["time"] > after]
        merged = next((r for r in records if r["partners"] > 0), None)
        if merged is not None:
            return records[0], merged
        time.sleep(POLL_S)  # the metrics file is the only signal a peer process gives
    raise TimeoutError(f"{name} did not merge within {MERGE_WAIT_S:.0f}s of starting")


def ready_for_takeover(standby) -> None:
    """Wait until a standby has built its model and waits for the checkpoint folder (its log says so)."""
    deadline = time.monotonic() + MERGE_WAIT_S
    while "standby: waiting to take over" not in standby.log_text():
        if not standby.running or time.monotonic() > deadline:
            raise RuntimeError(f"the standby is not ready; log tail:\n{standby.log_text()[-2000:]}")
        time.sleep(POLL_S)  # its log is the only signal a standby process gives


def restart_once(swarm: LocalSwarm, way: str, *, same_host: bool = False) -> dict:
    """Kill island 1, start it again `way`, and return where the time went until its first merged round.

    `same_host`: start it under its first command prefix (its network namespace) rather than `way`'s."""
    island = swarm.peers["island-1"]
    standby = swarm.standby("island-1") if way == "standby" else None
    if standby is not None:
        ready_for_takeover(standby)
    island.process.send_signal(signal.SIGKILL)
    island.process.wait()
    restarted_at = time.time()
    if standby is not None:
        swarm.promote(standby)
    else:
        swarm.restart("island-1", command_prefix=None if same_host else WAYS[way])
    first, merged = first_merge_after(swarm, "island-1", restarted_at)
    total = merged["time"] - restarted_at
    startup = {phase: first.get(phase) or 0.0 for phase in PHASES[:3]}
    row = {"way": way, **startup, "first_round_s": total - sum(startup.values()), "total_s": total}
    row["anchor_s"] = first.get("anchor_s")  # how far into restore_s its first round's training began (or None)
    row["resynced"] = bool(merged.get("resynced"))  # its first merge found it off the lineage: a second download
    row["total_over_restore"] = total / startup["restore_s"] if startup["restore_s"] else None
    return row


def run_restarts(restarts: int, tiny: bool, folder: Path) -> list[dict]:
    """Two islands; island 1 restarted `restarts` times each way, alternating, after a merged round each time."""
    rows = []
    shutil.rmtree(folder, ignore_errors=True)  # an earlier run's checkpoints would be resumed from
    with LocalSwarm(folder, run_id="restart-bench") as swarm:
        swarm.bootstrap()
        config = TINY if tiny else None
        for index in range(2):
            swarm.peer(f"island-{index}", "--shard-index", str(index), *FLAGS, config=config)
        first_merge_after(swarm, "island-1", 0.0)
        for number in range(restarts):
            for way in WAYS:
                row = restart_once(swarm, way)
                rows.append(row)
                print(
                    f"restart {number + 1}/{restarts} {way}: "
                    + ", ".join(f"{phase} {row[phase]:.2f}" for phase in PHASES)
                    + f", total {row['total_s']:.2f} s",
                    flush=True,
                )
    return rows


def summarise(rows: list[dict], imports: dict[str, list[float]]) -> dict:
    """Medians per way, and shipped over plain for the imports, the start-up phases and the whole restart."""
    median = {
        way: {key: statistics.median(r[key] for r in rows if r["way"] == way) for key in (*PHASES, "total_s")}
        for way in WAYS
    }
    for way in WAYS:
        median[way]["import_s"] = statistics.median(imports[way]) if way in IMPORT_WAYS else None
        median[way]["total_over_restore"] = median[way]["total_s"] / median[way]["restore_s"]
    keys = ("import_s", "process_start_s", "join_s", "total_s")
    ratio = {key: median["shipped"][key] / median["plain"][key] for key in keys}
    standby = {key: median["standby"][key] / median["shipped"][key] for key in ("total_s", "total_over_restore")}
    return {"median_s": median, "shipped_over_plain": ratio, "standby_over_shipped": standby}


def plot(summary: dict, path: Path) -> None:
    """Stacked restart phases (median seconds) for each way."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    for row, way in enumerate(WAYS):
        left = 0.0
        for phase, color in zip(PHASES, ("#4c72b0", "#dd8452", "#55a868", "#c44e52"), strict=True):
            width = summary["median_s"][way][phase]
            ax.barh(row, width, left=left, color=color, label=phase if row == 0 else None)
            left += width
    ax.set_yticks(range(len(WAYS)), list(WAYS))
    ax.set_xlabel("seconds from restart to first merged round (median)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Time the imports and the restarts each way; write restart.json and restart.png."""
    parser = benchmark_parser(__doc__, quick="1 restart and 1 import each way", smoke="tiny model, 1 of each")
    args = parser.parse_args(argv)
    restarts, import_runs = (1, 1) if args.smoke or args.quick else (3, 5)
    imports: dict[str, list[float]] = {way: [] for way in IMPORT_WAYS}
    for _ in range(import_runs):
        for way in IMPORT_WAYS:
            imports[way].append(import_seconds(way))
    print("import of the island, s: " + ", ".join(f"{way} {statistics.median(s):.2f}" for way, s in imports.items()))
    name = "restart-smoke" if args.smoke else "restart"
    rows = run_restarts(restarts, args.smoke, args.out / f"{name}-runs")
    summary = summarise(rows, imports)
    result = {**provenance("restart.py", argv), **summary, "imports_s": imports, "restarts": rows}
    path = write_result(args.out, name, result)
    plot(summary, args.out / f"{name}.png")
    for way, figures in summary["median_s"].items():
        print(f"{way}: " + ", ".join(f"{key} {value:.2f}" for key, value in figures.items() if value is not None))
    print("shipped / plain: " + ", ".join(f"{k} {v:.3f}" for k, v in summary["shipped_over_plain"].items()))
    print("standby / shipped: " + ", ".join(f"{k} {v:.3f}" for k, v in summary["standby_over_shipped"].items()))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
