"""One island per checkpoint folder: a second one is refused in one line, a standby waits and takes over."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from conftest import TINY, LocalSwarm, wait_until

from p2p_diloco.cli.launcher import spawn
from p2p_diloco.island.ownership import CheckpointFolderLock
from p2p_diloco.process import kill_process_tree

HOLDER = """
import os, sys
from p2p_diloco.cli.launcher import spawn
from p2p_diloco.island.ownership import CheckpointFolderLock
lock = CheckpointFolderLock(sys.argv[1])
lock.acquire_or_refuse()
forked_read, forked_write = os.pipe()
child = os.fork()
if child == 0:  # a forked helper, as the DHT and averager processes are: it must not keep the folder
    os.write(forked_write, b"1")  # past os.fork, so its at-fork hooks ran: what the test checks is in place
    sys.stdin.read()
    os._exit(0)
os.read(forked_read, 1)
print("HELD", child, flush=True)
sys.stdin.read()
"""


def _hold(folder: Path) -> tuple[subprocess.Popen, int]:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    word, child = holder.stdout.readline().split()
    assert word == "HELD"
    return holder, int(child)


def _peer(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "p2p_diloco", "peer", "--config", str(TINY), "--solo", "true", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)


def test_a_second_island_on_a_checkpoint_folder_in_use_is_refused_in_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    holder, child = _hold(folder)
    try:
        refused = _peer("--checkpoint-dir", str(folder), "--outer-steps", "1")
        errors = [line for line in refused.stderr.splitlines() if "error:" in line]
        assert refused.returncode == 2 and len(errors) == 1, refused.stderr[-2000:]
        assert f"is in use by another island (pid {holder.pid} on" in errors[0] and "--standby true" in errors[0]
        assert sorted(path.name for path in folder.iterdir()) == [".island.lock"], "it wrote nothing"
    finally:
        holder.stdin.close()
        holder.wait(30)
        kill_process_tree(child)
    trained = _peer("--checkpoint-dir", str(folder), "--outer-steps", "1")
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert any(path.name.startswith("ckpt-") for path in folder.iterdir())


def test_the_folder_is_free_once_its_island_is_killed_though_a_forked_child_lives_on(tmp_path: Path) -> None:
    holder, child = _hold(tmp_path)
    try:
        assert not CheckpointFolderLock(tmp_path).try_acquire()
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
        os.kill(child, 0)  # the forked child is still there
        assert CheckpointFolderLock(tmp_path).try_acquire()
    finally:
        kill_process_tree(holder.pid)
        kill_process_tree(child)


def test_a_standby_takes_over_the_checkpoint_of_an_island_killed_mid_run(local_swarm: LocalSwarm) -> None:
    solo = ["--solo", "true", "--outer-steps", "400"]
    island = local_swarm.peer("island", *solo, join=False)
    wait_until(lambda: len(island.records()) >= 3, 180, "the island's first checkpoints")
    folder = island.checkpoint_dir
    standby = local_swarm.peer("standby", *solo, "--checkpoint-dir", str(folder), "--standby", "true", join=False)
    wait_until(lambda: "standby: waiting to take over" in standby.log_text(), 180, "the standby to be ready")
    assert standby.running and not standby.records(), "a standby trains nothing while the island lives"

    island.process.send_signal(signal.SIGKILL)
    island.wait(30)
    last = island.records()[-1]["outer_step"]
    wait_until(lambda: len(standby.records()) >= 2, 180, "the standby to train on")
    log = standby.log_text()
    resumed = re.search(r"starting from checkpoint at outer step (\d+)", log)
    assert "standby: took over checkpoint folder" in log and resumed, log[-3000:]
    assert last - 1 <= int(resumed.group(1)) <= last  # the island's last checkpoint (one may have been in flight)
    first = standby.records()[0]
    assert first["outer_step"] == int(resumed.group(1)) + 1 and first["process_start_s"] is not None

    standby.process.send_signal(signal.SIGTERM)
    assert standby.wait(60) == 143, standby.log_text()[-2000:]
    assert "the last checkpoint is kept" in standby.log_text()


def test_a_standby_needs_the_folder_it_stands_by_for() -> None:
    result = _peer("--standby", "true", "--outer-steps", "1")
    assert result.returncode == 2 and "--standby true takes over an island's --checkpoint-dir" in result.stderr


def test_a_standby_on_a_free_folder_takes_it_at_once(tmp_path: Path) -> None:
    assert CheckpointFolderLock(tmp_path).wait() == 0.0
    assert not CheckpointFolderLock(tmp_path).try_acquire()


def test_a_standby_stops_while_it_waits_on_sigterm(tmp_path: Path) -> None:
    folder, log = tmp_path / "ckpt", tmp_path / "standby.log"
    holder, child = _hold(folder)
    args = ["peer", "--config", str(TINY), "--solo", "true", "--checkpoint-dir", str(folder), "--standby", "true"]
    standby = spawn(args, log_path=log)
    try:
        wait_until(lambda: "standby: waiting to take over" in log.read_text(), 120, "the standby to wait")
        assert f"from pid {holder.pid} on" in log.read_text()
        standby.send_signal(signal.SIGTERM)
        assert standby.wait(30) == 143, log.read_text()[-2000:]
        assert "stopped by SIGTERM before training started" in log.read_text()
    finally:
        kill_process_tree(standby.pid)
        holder.stdin.close()
        holder.wait(30)
        kill_process_tree(child)
