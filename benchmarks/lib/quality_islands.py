"""The quality benchmark's island systems, started with p2p_diloco.cli.launcher.LocalSwarm: (c) a real local
swarm of 4 islands with quorum 4, and (b) 4 isolated islands side by side, island 0 of which is (d) one island alone.

Evaluation is what the benchmark measures, not what it should spend its time on: the swarm's islands hold
bit-identical anchors after every round (quorum 4, checked by `anchor_digests_agree`), so island 0 evaluates on the
full held-out set and the other three on one batch, the least an island evaluates (their losses are not used). That
saves CPU, not the rounds' pace: island 0's evaluation (0.34 s of a 1.06 s round at T=144, H=5, 8 batches) still
holds up the lockstep rounds, so the swarm's wall time fell only 229/198/196 s -> 219/199/180 s (seeds 0/1/2).
"""

from __future__ import annotations

import time
from pathlib import Path

from lib.quality_common import ISLANDS, Progress, check_codes, peer_config_args, timeout_for
from p2p_diloco.cli.launcher import LocalSwarm

OTHER_ISLANDS_EVAL_BATCHES = 1
"""Eval batches of swarm islands 1-3, whose anchors are bit-identical to island 0's."""


def island_curve(records_by_island: list[list[dict]], evaluated: list[int] | None = None) -> dict:
    """System curve of islands that step in lockstep: tokens summed over islands, eval loss averaged over the
    `evaluated` islands (default: all)."""
    steps = min(len(records) for records in records_by_island)
    evaluated = list(range(len(records_by_island))) if evaluated is None else evaluated
    curve = {"tokens": [], "eval_loss": [], "inner_steps": [], "eval_loss_spread": []}
    for index in range(steps):
        rows = [records[index] for records in records_by_island]
        losses = [rows[island]["eval_loss"] for island in evaluated]
        if None in losses:
            continue  # a round between evaluations (--eval-every)
        curve["tokens"].append(sum(row["tokens"] for row in rows))
        curve["eval_loss"].append(sum(losses) / len(losses))
        curve["inner_steps"].append(rows[0]["inner_steps_total"])
        curve["eval_loss_spread"].append(max(losses) - min(losses))
    if len(evaluated) < 2:  # one island's eval has no spread to report
        del curve["eval_loss_spread"]
    return curve


class BrokenRound(RuntimeError):
    """A p2p round that did not average all four islands: the run no longer measures p2p-diloco."""


def _every_island_merged(record: dict) -> None:
    if record["partners"] != ISLANDS - 1:
        raise BrokenRound(
            f"outer step {record['outer_step']} of {record['peer_id'][:16]} averaged with {record['partners']} "
            f"of {ISLANDS - 1} islands ({record.get('note')})"
        )


def run_p2p(settings: dict, folder: Path, attempts: int = 3) -> dict:
    """(c): a bootstrap and 4 peers with quorum 4, so every round averages all four islands.

    A round without all four islands (a failed all-reduce) stops the run, which is started again from scratch,
    at most `attempts` times: the comparison is meant for p2p-diloco that works, and the failures are recorded.
    """
    failures = []
    for attempt in range(1, attempts + 1):
        try:
            result = _p2p_attempt(settings, folder)
        except BrokenRound as error:
            failures.append(str(error))
            print(f"  attempt {attempt} of {attempts}: {error}; starting the swarm again", flush=True)
            continue
        result["failed_attempts"] = failures
        return result
    raise RuntimeError(f"the p2p-diloco swarm failed {attempts} times: {failures}")


def _p2p_attempt(settings: dict, folder: Path) -> dict:
    swarm = LocalSwarm(folder, run_id="quality")
    started = time.monotonic()
    try:
        swarm.bootstrap()
        for index in range(ISLANDS):
            evaluation = {} if index == 0 else {"eval_batches": OTHER_ISLANDS_EVAL_BATCHES}
            args = ["--shard-index", str(index), *peer_config_args({**settings, **evaluation})]
            args += ["--target-group-size", str(ISLANDS), "--quorum", str(ISLANDS), "--averaging-timeout", "120"]
            args += ["--join-timeout", "120"]  # a loaded machine can be slow to start the DHT
            swarm.peer(f"island-{index}", *args, fresh_metrics=True, checkpoints=False)
        progress = Progress(
            {n: p.metrics for n, p in swarm.peers.items()}, settings["outer_steps"], _every_island_merged
        )
        codes = progress.follow([p.process for p in swarm.peers.values()], timeout_for(settings), "the swarm")
    finally:
        swarm.close(grace=10)
    wall = time.monotonic() - started
    check_codes(codes, "the p2p-diloco swarm", [p.log for p in swarm.peers.values()])
    records = list(swarm.records().values())
    curve = island_curve(records, evaluated=[0])
    partners = [r["partners"] for island in records for r in island]
    digests_agree = all(len({island[k]["anchor_digest"] for island in records}) == 1 for k in range(len(records[0])))
    return {
        "curve": curve,
        "final_eval_loss": curve["eval_loss"][-1],
        "total_tokens": curve["tokens"][-1],
        "steps": curve["inner_steps"][-1],
        "evaluated_by": f"island 0 ({settings['eval_batches']} batches): every island holds the same anchor "
        "(anchor_digests_agree), so islands 1-3 evaluate one batch, unused",
        "mean_partners": sum(partners) / len(partners),
        "rounds_with_all_islands": sum(p == ISLANDS - 1 for p in partners) / len(partners),
        "anchor_digests_agree": digests_agree,
        "mean_wait_s": sum(r["wait_s"] for island in records for r in island) / len(partners),
        "wall_s": wall,
    }


def run_solo(settings: dict, folder: Path) -> tuple[dict, dict]:
    """(b) and (d): 4 solo islands on the 4 shards, side by side; island 0 alone is (d), the single island."""
    runs = {f"isolated-{i}": i for i in range(ISLANDS)}
    swarm = LocalSwarm(folder)
    started = time.monotonic()
    try:
        for name, shard in runs.items():
            args = ["--solo", "true", "--run-id", f"quality-{name}", "--shard-index", str(shard)]
            swarm.peer(name, *args, *peer_config_args(settings), join=False, fresh_metrics=True, checkpoints=False)
        codes = Progress({n: p.metrics for n, p in swarm.peers.items()}, settings["outer_steps"]).follow(
            [p.process for p in swarm.peers.values()], timeout_for(settings) * 1.5, "the solo islands"
        )
    finally:
        swarm.close(grace=10)
    wall = time.monotonic() - started
    check_codes(codes, "the solo islands", [p.log for p in swarm.peers.values()])
    records = swarm.records()
    return _isolated(records, wall), _single(records, wall)


def _isolated(records: dict[str, list[dict]], wall: float) -> dict:
    isolated_records = [records[f"isolated-{i}"] for i in range(ISLANDS)]
    curve = island_curve(isolated_records)
    finals = [island[-1]["eval_loss"] for island in isolated_records]
    return {
        "curve": curve,
        "final_eval_loss": sum(finals) / len(finals),
        "final_eval_loss_per_island": finals,
        "total_tokens": curve["tokens"][-1],
        "steps": curve["inner_steps"][-1],
        "wall_s": wall,
        "note": "4 islands with --solo true (each applies its own outer Nesterov step); loss = mean over islands",
    }


def _single(records: dict[str, list[dict]], wall: float) -> dict:
    single_records = [r for r in records["isolated-0"] if r["eval_loss"] is not None]
    return {
        "curve": {
            "tokens": [r["tokens"] for r in single_records],
            "eval_loss": [r["eval_loss"] for r in single_records],
            "inner_steps": [r["inner_steps_total"] for r in single_records],
        },
        "final_eval_loss": single_records[-1]["eval_loss"],
        "total_tokens": single_records[-1]["tokens"],
        "steps": single_records[-1]["inner_steps_total"],
        "wall_s": wall,
        "note": (
            "one solo island on shard 0 for the same T*H steps: it trains on 1/4 of the total tokens of the "
            "other systems. It is isolated island 0 (same shard, seed and steps: a separate run was bit-identical "
            "to it, so the benchmark no longer trains it twice)"
        ),
    }
