"""A swarm that outlives its bootstrap, a view of it (status, dashboard), clean stops, one-line network errors.

All on 127.0.0.1 with real processes; the dashboard is loaded in a real headless Chromium when one is installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from conftest import LocalSwarm, wait_until

LONG = ["--outer-steps", "300", "--rebootstrap-s", "3", "--target-group-size", "4"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def merges(peer) -> int:
    return sum(record["partners"] > 0 for record in peer.records())


def join_line_of(peer) -> list[str]:
    """The `--initial-peers X --run-id R` an island printed for others to paste."""
    match = re.search(r"others can join through it: p2p-diloco peer (.*)$", peer.log_text(), re.MULTILINE)
    assert match, peer.log_text()[-2000:]
    return match.group(1).split()


def test_a_swarm_survives_its_bootstrap(local_swarm: LocalSwarm, tmp_path: Path) -> None:
    identity, port = tmp_path / "bootstrap.key", free_port()
    boot_args = ["--identity", str(identity), "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}"]
    maddrs = local_swarm.bootstrap(host=None, extra_args=boot_args)
    early = [local_swarm.peer(f"island-{i}", *LONG, "--shard-index", str(i), "--num-shards", "4") for i in range(2)]
    wait_until(lambda: all(merges(peer) >= 3 for peer in early), 180, "the first islands to merge")

    # The bootstrap dies and comes back with its identity: an empty routing table, the same multiaddr.
    first = local_swarm.bootstrap_process
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    assert local_swarm.bootstrap(host=None, extra_args=boot_args) == maddrs
    newcomer = local_swarm.peer("newcomer", *LONG, "--shard-index", "2", "--num-shards", "4")
    wait_until(lambda: merges(newcomer) >= 2, 180, "the newcomer to join the running swarm")
    log = newcomer.log_text()
    # Its first DHT lookup may find the swarm's state, or it starts fresh and its first round resynchronises it.
    joined = ("starting from swarm state at outer step", "resynced to outer step", "resynchronised anchor from")
    assert any(line in log for line in joined), log[-3000:]
    swarm_step = max(record["outer_step"] for peer in early for record in peer.records())
    assert newcomer.records()[-1]["outer_step"] >= swarm_step - 2

    # The bootstrap is gone for good: a second newcomer joins through an island's printed multiaddr.
    local_swarm.bootstrap_process.send_signal(signal.SIGKILL)
    line = join_line_of(early[0])
    second = local_swarm.peer("second", *line, *LONG, "--shard-index", "3", "--num-shards", "4", join=False)
    wait_until(lambda: merges(second) >= 2, 180, "a newcomer to join through an island")
    assert "starting from swarm state at outer step" in second.log_text(), second.log_text()[-3000:]
    for peer in [*early, newcomer, second]:
        assert peer.running, peer.log_text()[-2000:]


@pytest.fixture
def finished_swarm(local_swarm: LocalSwarm) -> LocalSwarm:
    """Three islands that trained 3 outer steps together and exited (their records stay in the DHT)."""
    local_swarm.bootstrap()
    args = ["--outer-steps", "3", "--num-shards", "3", "--target-group-size", "3"]
    peers = [local_swarm.peer(f"island-{i}", *args, "--shard-index", str(i)) for i in range(3)]
    for peer in peers:
        assert peer.wait(240) == 0, peer.log_text()[-3000:]
    return local_swarm


def cli(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "p2p_diloco", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_status_lists_every_island_with_its_outer_step(finished_swarm: LocalSwarm) -> None:
    # The bootstrap outlives the islands and holds their last records.
    result = cli("status", "--initial-peers", *finished_swarm.maddrs, "--run-id", "test", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    by_peer = {row["peer_id"]: row for row in report["islands"]}
    peers = finished_swarm.peers.values()
    assert set(by_peer) == {peer.records()[-1]["peer_id"] for peer in peers}
    for peer in peers:
        last = peer.records()[-1]
        row = by_peer[last["peer_id"]]
        assert row["outer_step"] == last["outer_step"] == 3
        assert row["eval_loss"] == pytest.approx(last["eval_loss"], abs=1e-3)
        assert row["reachability"] == "direct" and row["codec"] == "fp32" and row["history"]
    assert report["clock"] == 3 and report["total_tokens"] == sum(p.records()[-1]["tokens"] for p in peers)
    table = cli("status", "--initial-peers", *finished_swarm.maddrs, "--run-id", "test")
    assert "swarm clock 3" in table.stdout and len(table.stdout.strip().splitlines()) == 5, table.stdout
    runs = cli("swarms", "--initial-peers", *finished_swarm.maddrs, "--json")
    assert json.loads(runs.stdout)["runs"]["test"]["islands"] >= 1, runs.stdout


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
BROWSER_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--virtual-time-budget=6000",
]


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (apt-get install -y chromium)")
def test_the_dashboard_shows_the_islands_in_a_browser(finished_swarm: LocalSwarm, tmp_path: Path) -> None:
    port = free_port()
    command = [sys.executable, "-m", "p2p_diloco", "dashboard", "--initial-peers", *finished_swarm.maddrs]
    command += ["--run-id", "test", "--port", str(port), "--interval", "0.5"]
    log = open(tmp_path / "dashboard.log", "w")  # noqa: SIM115 - closed with the process below
    dashboard = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        line = dashboard.stdout.readline()
        assert f"http://127.0.0.1:{port}/" in line, (tmp_path / "dashboard.log").read_text()[-3000:]
        url = f"http://127.0.0.1:{port}/"
        profile = ["--user-data-dir=" + str(tmp_path / "profile")]
        dom = subprocess.run(
            [CHROMIUM, *BROWSER_FLAGS, *profile, "--dump-dom", url], capture_output=True, text=True, timeout=120
        ).stdout
        peers = [peer.records()[-1]["peer_id"] for peer in finished_swarm.peers.values()]
        assert dom.count("<tr data-peer=") == 3, dom[:3000]
        for peer in peers:
            assert f'data-peer="{peer}"' in dom  # its table row and its loss curve
        assert dom.count("<polyline") >= 3 and 'class="round"' in dom
        screenshot = tmp_path / "dashboard.png"
        subprocess.run(
            [CHROMIUM, *BROWSER_FLAGS, *profile, "--window-size=1280,900", f"--screenshot={screenshot}", url],
            capture_output=True,
            timeout=120,
        )
        from matplotlib.image import imread

        pixels = imread(screenshot)[..., :3]
        first_island_blue = (abs(pixels - [0x1F / 255, 0x77 / 255, 0xB4 / 255]).sum(axis=-1) < 0.05).sum()
        merged_green = (abs(pixels - [0x2C / 255, 0xA0 / 255, 0x2C / 255]).sum(axis=-1) < 0.05).sum()
        assert first_island_blue > 50 and merged_green > 20, (first_island_blue, merged_green)
    finally:
        dashboard.send_signal(signal.SIGINT)
        code = dashboard.wait(30)
        log.close()
        assert code == 130


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stop_signal_stops_an_island_cleanly(local_swarm: LocalSwarm, sig: int, code: int) -> None:
    local_swarm.bootstrap()
    peers = [
        local_swarm.peer(f"island-{i}", "--outer-steps", "300", "--shard-index", str(i), "--num-shards", "2")
        for i in range(2)
    ]
    wait_until(lambda: all(len(peer.records()) >= 2 for peer in peers), 180, "two rounds")
    victim = peers[0]
    island_group = os.getpgid(victim.process.pid)
    daemons = [p for p in psutil.Process(victim.process.pid).children(recursive=True) if p.name() == "p2pd"]
    # Go ends p2pd on SIGTERM even when it starts ignored: it must not share the group the signal goes to.
    assert daemons and all(os.getpgid(daemon.pid) != island_group for daemon in daemons), daemons
    victim.signal_group(sig)  # as a terminal's Ctrl-C does: the whole process group
    assert victim.wait(30) == code
    log = victim.log_text()
    assert "Traceback" not in log and "terminate called" not in log, log[-3000:]
    assert f"stopped by {signal.Signals(sig).name}" in log
    assert peers[1].running


def test_an_unreachable_announce_address_and_a_refusing_relay_are_reported(local_swarm: LocalSwarm) -> None:
    local_swarm.bootstrap(extra_args=["--relay-max-islands", "0"])
    args = ["--outer-steps", "1", "--announce-maddrs", "/ip4/127.0.0.1/tcp/1", "--relay", "only"]
    peer = local_swarm.peer("island", *args)
    assert peer.wait(120) == 0, peer.log_text()[-3000:]
    log = peer.log_text()
    assert "--announce-maddrs /ip4/127.0.0.1/tcp/1 is not reachable" in log, log[-3000:]
    assert "refused a reservation (relay 127.0.0.1" in log and "relay full (0 islands)" in log, log[-3000:]
    assert "averaging in client mode" in log


def test_an_island_of_another_protocol_version_is_refused_in_one_line(local_swarm: LocalSwarm) -> None:
    from p2p_diloco.net.dht import shutdown_dht, start_dht
    from p2p_diloco.net.records import PROTOCOL_VERSION, RunRecords

    maddrs = local_swarm.bootstrap()
    future_islands = []
    try:
        for _ in range(2):  # one island's word alone is only a warning
            dht = start_dht(
                initial_peers=maddrs,
                host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                announce_maddrs=[],
                identity=None,
                timeout=30,
            )
            future_islands.append(dht)
            future = {"protocol": 99, "version": "9.0.0", "fingerprint": "x", "codec": "fp32", "outer_step": 1}
            # Records are signed by their owner's key, so a future island announces under its own peer id.
            RunRecords(dht, "test", dht.peer_id.to_base58(), ttl=120, timeout=10).announce(future, check=False)
        peer = local_swarm.peer("island", "--outer-steps", "1")
        assert peer.wait(120) == 2
        errors = [line for line in peer.log_text().splitlines() if "error:" in line]
        assert len(errors) == 1 and "protocol mismatch" in errors[0] and "99" in errors[0], peer.log_text()[-2000:]
        assert f"this island speaks {PROTOCOL_VERSION}" in errors[0] and "9.0.0" in errors[0]
    finally:
        for dht in future_islands:
            shutdown_dht(dht)
