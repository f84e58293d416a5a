"""Islands of several processes: ranks on torch.distributed (gloo on CPU) inside, one swarm member outside."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import TINY, LocalSwarm, wait_until

from p2p_diloco.cli.launcher import PeerProcess
from p2p_diloco.process import kill_process_tree
from p2p_diloco.train.checkpoint import latest_checkpoint, load_checkpoint

SOLO = ["--solo", "true", "--inner-steps", "5", "--lr", "1e-3", "--log-level", "WARNING"]
"""Islands without a network, for comparing their weights."""
EQUAL = 1e-5
TINY_LLAMA = TINY.parent / "tiny-llama.toml"


def run_island(folder: Path, *args: str, ranks: int = 1, timeout: float = 180) -> dict:
    """Run one island to its end (through torchrun for ranks > 1 or with --island-parallel); its last checkpoint."""
    command = [sys.executable, "-m", "p2p_diloco", "peer", "--config", str(TINY), *SOLO, *args]
    command += ["--checkpoint-dir", str(folder), "--metrics", str(folder / "metrics.jsonl")]
    if ranks > 1:
        command += ["--nproc-per-node", str(ranks)]
    elif "--island-parallel" in args:  # one rank of torch.distributed: what a 1-GPU torchrun island runs
        command[1:3] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", "p2p_diloco"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return load_checkpoint(latest_checkpoint(folder))


def max_difference(first: dict, second: dict) -> float:
    """The largest difference between two checkpoints' anchors."""
    assert first["outer_step"] == second["outer_step"]
    return (first["anchor"] - second["anchor"]).abs().max().item()


def rank_processes(peer: PeerProcess) -> dict[int, psutil.Process]:
    """The island's rank processes by rank (children of its launcher that torch's launcher gave a RANK)."""
    ranks = {}
    for child in psutil.Process(peer.process.pid).children(recursive=True):
        try:
            if "RANK" in (environment := child.environ()) and "p2p_diloco" in " ".join(child.cmdline()):
                ranks[int(environment["RANK"])] = child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return ranks


def test_a_two_rank_island_trains_as_one_rank_with_the_global_batch(tmp_path: Path) -> None:
    steps = ["--outer-steps", "3"]
    single = run_island(tmp_path / "single", *steps, "--batch-size", "8")
    ddp = run_island(tmp_path / "ddp", *steps, "--batch-size", "4", ranks=2)
    fsdp = run_island(tmp_path / "fsdp", *steps, "--batch-size", "4", "--island-parallel", "fsdp", ranks=2)
    assert max_difference(single, ddp) < EQUAL
    assert max_difference(ddp, fsdp) < EQUAL
    assert single["tokens"] == ddp["tokens"] == fsdp["tokens"]
    assert "inner_shards" in fsdp and (tmp_path / "fsdp" / fsdp["inner_shards"] / ".metadata").is_file()

    from p2p_diloco.train.metrics import read_metrics

    records = read_metrics(tmp_path / "ddp" / "metrics.jsonl")
    assert (records[-1]["ranks"], records[-1]["island_parallel"]) == (2, "ddp")
    assert records[-1]["eval_loss"] < records[0]["eval_loss"] - 0.1  # it trained: equal weights are no accident
    assert read_metrics(tmp_path / "single" / "metrics.jsonl")[-1]["ranks"] == 1


def test_a_transformers_model_sharded_with_fsdp_trains_as_one_rank(tmp_path: Path) -> None:
    llama = ["--config", str(TINY_LLAMA), "--outer-steps", "2"]
    single = run_island(tmp_path / "single", *llama, "--batch-size", "8")
    fsdp = run_island(tmp_path / "fsdp", *llama, "--batch-size", "4", "--island-parallel", "fsdp", ranks=2)
    assert max_difference(single, fsdp) < EQUAL


def test_streaming_fragments_with_overlap_land_the_same_on_every_rank(tmp_path: Path) -> None:
    streaming = ["--outer-steps", "4", "--fragments", "2", "--overlap-steps", "1"]
    single = run_island(tmp_path / "single", *streaming, "--batch-size", "8")
    ddp = run_island(tmp_path / "ddp", *streaming, "--batch-size", "4", ranks=2)
    assert max_difference(single, ddp) < EQUAL


def test_an_fsdp_island_resumes_from_its_shards_on_the_same_and_on_fewer_ranks(tmp_path: Path) -> None:
    fsdp = ["--island-parallel", "fsdp"]
    straight = run_island(tmp_path / "straight", "--outer-steps", "4", "--batch-size", "4", *fsdp, ranks=2)
    run_island(tmp_path / "resumed", "--outer-steps", "2", "--batch-size", "4", *fsdp, ranks=2)
    subprocess.run(["cp", "-r", str(tmp_path / "resumed"), str(tmp_path / "one-rank")], check=True)
    resumed = run_island(tmp_path / "resumed", "--outer-steps", "4", "--batch-size", "4", *fsdp, ranks=2)
    assert max_difference(straight, resumed) < EQUAL
    one_rank = run_island(tmp_path / "one-rank", "--outer-steps", "4", "--batch-size", "8", *fsdp)
    assert max_difference(straight, one_rank) < EQUAL

    # DDP cannot take FSDP's sharded optimizer: a one-line error that says what to do, and nothing is deleted
    command = [sys.executable, "-m", "p2p_diloco", "peer", "--config", str(TINY), *SOLO, "--outer-steps", "6"]
    command += ["--checkpoint-dir", str(tmp_path / "one-rank"), "--nproc-per-node", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode != 0
    assert "written by an FSDP island" in done.stderr and "--fresh" in done.stderr, done.stderr[-2000:]
    assert latest_checkpoint(tmp_path / "one-rank") is not None


def test_a_two_rank_island_and_a_one_rank_island_merge_every_round(local_swarm: LocalSwarm) -> None:
    local_swarm.bootstrap()
    args = ["--outer-steps", "4", "--quorum", "2", "--target-group-size", "2", "--wait-for-islands", "2"]
    ranked = local_swarm.peer("ranked", *args, "--nproc-per-node", "2", "--batch-size", "4")
    single = local_swarm.peer("single", *args, "--batch-size", "8")
    for island in (ranked, single):
        assert island.wait(240) == 0, island.log_text()[-3000:]
    records = {island.name: island.records() for island in (ranked, single)}
    assert {r["ranks"] for r in records["ranked"]} == {2} and {r["ranks"] for r in records["single"]} == {1}
    by_step = {r["outer_step"]: r for r in records["single"]}
    merged = [r for r in records["ranked"] if r["merged"] and by_step.get(r["outer_step"], {}).get("merged")]
    assert len(merged) >= 3, [(r["outer_step"], r["merged"], r["note"]) for r in records["ranked"]]
    for record in merged:
        assert record["partners"] >= 1
        assert record["anchor_digest"] == by_step[record["outer_step"]]["anchor_digest"]
    assert records["ranked"][-1]["tokens"] == records["single"][-1]["tokens"]  # 2 ranks x 4 rows = 8 rows


def test_a_killed_rank_ends_its_island_and_the_swarm_goes_on(local_swarm: LocalSwarm) -> None:
    local_swarm.bootstrap()
    ranked = local_swarm.peer("ranked", "--outer-steps", "40", "--nproc-per-node", "2", "--batch-size", "4")
    other = local_swarm.peer("other", "--outer-steps", "8")
    wait_until(lambda: len(ranked.records()) >= 2, 180, "two rounds of the two-rank island")
    ranks = rank_processes(ranked)
    assert set(ranks) == {0, 1}
    family = psutil.Process(ranked.process.pid).children(recursive=True)  # ranks, rank 0's DHT, p2pd
    killed_at = time.monotonic()
    ranks[1].send_signal(signal.SIGKILL)
    code = ranked.wait(60)
    ended_s = time.monotonic() - killed_at
    assert code != 0
    error = [line for line in ranked.log_text().splitlines() if line.startswith("p2p-diloco peer: error:")]
    assert len(error) == 1 and "rank 1" in error[0] and "SIGKILL" in error[0], ranked.log_text()[-3000:]
    assert ended_s < 30, ended_s
    _, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, [(process.pid, process.cmdline()) for process in alive]
    assert other.wait(240) == 0, other.log_text()[-3000:]
    assert other.records()[-1]["outer_step"] == 8
    print(f"the island ended {ended_s:.1f}s after its rank 1 was killed")


def test_a_killed_island_resumes_from_its_checkpoint_and_max_restarts_restarts_it_in_place(
    local_swarm: LocalSwarm,
) -> None:
    args = ["--solo", "true", "--outer-steps", "30", "--nproc-per-node", "2", "--batch-size", "4", "--slowdown", "4"]
    island = local_swarm.peer("ranked", *args, join=False)
    wait_until(lambda: len(island.records()) >= 3, 180, "three rounds")
    kill_process_tree(island.process.pid)
    island.process.wait(10)
    step = load_checkpoint(latest_checkpoint(island.checkpoint_dir))["outer_step"]
    assert step >= 2

    again = local_swarm.peer("ranked", *args, "--max-restarts", "1", join=False)
    wait_until(lambda: f"checkpoint at outer step {step}" in again.log_text(), 120, "the resume from the checkpoint")
    wait_until(lambda: len(rank_processes(again)) == 2 and again.records()[-1]["outer_step"] > step + 1, 120, "rounds")
    before = again.records()[-1]["outer_step"]
    rank_processes(again)[1].send_signal(signal.SIGKILL)  # one restart allowed: the island comes back in place
    assert again.wait(300) == 0, again.log_text()[-3000:]
    assert again.log_text().count("starting from checkpoint at outer step") == 2
    assert again.records()[-1]["outer_step"] == 30 and before < 30


@pytest.mark.parametrize(
    "flags",
    [
        ["--nnodes", "2"],
        ["--island-parallel", "zero"],
        ["--nproc-per-node", "0"],
        ["--nproc-per-node", "2", "--device", "cuda"],  # refused before any rank starts
    ],
)
def test_bad_island_flags_are_one_line_errors(flags: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "p2p_diloco", "peer", "--config", str(TINY), "--solo", "true", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "error:" in done.stderr, done.stderr


def test_sigterm_stops_a_ranked_island_at_a_safe_point(local_swarm: LocalSwarm) -> None:
    args = ["--solo", "true", "--outer-steps", "30", "--nproc-per-node", "2", "--batch-size", "4", "--slowdown", "4"]
    island = local_swarm.peer("ranked", *args, join=False)
    wait_until(lambda: len(island.records()) >= 2, 180, "two rounds")
    family = psutil.Process(island.process.pid).children(recursive=True)
    island.process.send_signal(signal.SIGTERM)  # as systemd stops the service: the launcher passes it on
    assert island.wait(60) == 143, island.log_text()[-3000:]
    assert "stopped by SIGTERM at outer step" in island.log_text()
    step = load_checkpoint(latest_checkpoint(island.checkpoint_dir))["outer_step"]
    assert step >= island.records()[-1]["outer_step"]  # the stop wrote a checkpoint of the last round
    _, alive = psutil.wait_procs(family, timeout=10)
    assert not alive


def test_an_island_of_two_nodes_rendezvous_and_trains_as_one(local_swarm: LocalSwarm) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = ["--solo", "true", "--outer-steps", "3", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    nodes = [local_swarm.peer(f"node-{i}", *args, "--batch-size", "4", join=False) for i in range(2)]
    for node in nodes:
        assert node.wait(180) == 0, node.log_text()[-3000:]
    written = [node.records() for node in nodes if node.records()]
    assert len(written) == 1  # only global rank 0 writes the island's metrics
    assert written[0][-1]["ranks"] == 2 and written[0][-1]["outer_step"] == 3


def test_the_launcher_names_the_killed_rank_not_the_rank_that_noticed() -> None:
    """Rank 0 exits at once when rank 1 dies; in the same second, the launcher must still name rank 1."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from p2p_diloco.cli.launch import first_own_failure
    from p2p_diloco.island.ranks import LOST_RANKS_EXIT

    noticed = ProcessFailure(local_rank=0, pid=100, exitcode=LOST_RANKS_EXIT, error_file="/nonexistent")
    killed = ProcessFailure(local_rank=1, pid=101, exitcode=-signal.SIGKILL, error_file="/nonexistent")
    crashed = ProcessFailure(local_rank=2, pid=102, exitcode=1, error_file="/nonexistent")
    for failure in (noticed, killed, crashed):
        failure.timestamp = 1_000
    assert first_own_failure(ChildFailedError("peer", {0: noticed, 1: killed}))[0] == 1
    assert first_own_failure(ChildFailedError("peer", {0: noticed, 2: crashed, 1: killed}))[0] == 1
    crashed.timestamp = 999
    assert first_own_failure(ChildFailedError("peer", {0: noticed, 2: crashed, 1: killed}))[0] == 2
    assert first_own_failure(ChildFailedError("peer", {0: noticed}))[0] == 0
    # The agent SIGTERMs the others when one rank aborts: the aborted one is named, not the one it stopped.
    aborted = ProcessFailure(local_rank=1, pid=103, exitcode=-signal.SIGABRT, error_file="/nonexistent")
    terminated = ProcessFailure(local_rank=0, pid=104, exitcode=-signal.SIGTERM, error_file="/nonexistent")
    aborted.timestamp = terminated.timestamp = 1_000
    assert first_own_failure(ChildFailedError("peer", {0: terminated, 1: aborted}))[0] == 1
