"""Shared fixtures: real local swarms of bootstrap and peer processes, and a check that no daemon outlives a test."""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from members import Members

from p2p_diloco.cli import launcher
from p2p_diloco.cli.launcher import PeerProcess

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "peers" / "tiny.toml"


# Children inherit this marker (hivemind passes its environment to p2pd), so daemons of other test runs
# sharing the machine are told apart from ours.
RUN_MARKER = f"{os.getpid()}-{time.time_ns()}"
os.environ["P2P_DILOCO_TEST_RUN"] = RUN_MARKER


def p2pd_processes() -> dict[int, psutil.Process]:
    """Live p2pd daemons started by this test run, by pid."""
    found = {}
    for process in psutil.process_iter(["name", "status"]):
        if process.info["name"] != "p2pd" or process.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if process.environ().get("P2P_DILOCO_TEST_RUN") == RUN_MARKER:
                found[process.pid] = process
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.2) -> None:
    """Poll `predicate` until it holds; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def _stale_socket(path: str) -> bool:
    """A unix socket nobody listens on any more."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return True
        except OSError:
            return False
    return False


@pytest.fixture(autouse=True)
def no_leftover_daemons() -> Iterator[None]:
    """Fail a test that leaves p2pd daemons behind, and clean up its stale unix sockets."""
    before = set(p2pd_processes())
    sockets_before = set(glob.glob("/tmp/hivemind-*.sock"))
    yield
    new = [process for pid, process in p2pd_processes().items() if pid not in before]
    _, alive = psutil.wait_procs(new, timeout=10)
    for process in alive:
        process.kill()
    for path in set(glob.glob("/tmp/hivemind-*.sock")) - sockets_before:
        if _stale_socket(path):  # other runs on this machine may own live sockets: leave those alone
            try:
                os.unlink(path)
            except OSError:
                pass
    assert not alive, f"p2pd daemons outlived the test: {[process.pid for process in alive]}"


class LocalSwarm(launcher.LocalSwarm):
    """The project's launcher, with islands of the tiny config by default."""

    def peer(self, name: str, *args: str, config: Path | None = TINY, **kwargs) -> PeerProcess:
        """Start one island (tiny config unless told otherwise); see `p2p_diloco.cli.launcher.LocalSwarm.peer`."""
        return super().peer(name, *args, config=config, **kwargs)


@pytest.fixture
def local_swarm(tmp_path: Path) -> Iterator[LocalSwarm]:
    """A LocalSwarm in a temporary folder, torn down even when the test fails."""
    swarm = LocalSwarm(tmp_path)
    try:
        yield swarm
    finally:
        swarm.close(grace=10)


@pytest.fixture
def members() -> Iterator[Members]:
    """Member processes of one averaging group, all killed (with their daemons) after the test."""
    group = Members()
    try:
        yield group
    finally:
        group.close()
