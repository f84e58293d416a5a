"""Across separate hosts (network namespaces): the printed line is all a user pastes, NATs, relays, client mode.

Each test builds its own little internet (a bridge, hosts, NAT routers with MASQUERADE and inbound dropped) and
removes it even when it fails. Islands run with their defaults: they listen on every interface of their host.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import benchmarks_path  # noqa: F401
import pytest
from conftest import TINY, LocalSwarm, wait_until
from lib.netns import Internet, available

REASON = available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"separate hosts need network namespaces: {REASON}")

ROUND = ["--outer-steps", "4", "--quorum", "2", "--averaging-timeout", "20", "--num-shards", "3"]


@pytest.fixture
def internet() -> Internet:
    net = Internet()
    try:
        yield net
    finally:
        net.close()


def printed_line(swarm: LocalSwarm) -> list[str]:
    """The `p2p-diloco peer ...` arguments the bootstrap printed, exactly."""
    words = shlex.split(swarm.bootstrap_process.join_line)
    assert words[:2] == ["p2p-diloco", "peer"], words
    return words[2:]


def start(swarm: LocalSwarm, name: str, host, line: list[str], *args: str):
    return swarm.peer(name, *line, *args, config=TINY, join=False, host=None, command_prefix=host.prefix)


def merged_rounds(peer) -> list[int]:
    return [record["partners"] for record in peer.records()]


def test_islands_on_other_hosts_merge_with_the_printed_line(internet: Internet, tmp_path: Path) -> None:
    boot, a, b = internet.public_host("boot"), internet.public_host("a"), internet.public_host("b")
    swarm = LocalSwarm(tmp_path, run_id="bridge")
    try:
        swarm.bootstrap(host=None, command_prefix=boot.prefix)
        line = printed_line(swarm)
        assert "127.0.0.1" not in " ".join(line) and boot.address in " ".join(line)
        peers = [
            start(swarm, f"island-{i}", host, line, *ROUND, "--shard-index", str(i)) for i, host in enumerate((a, b))
        ]
        for peer in peers:
            assert peer.wait(240) == 0, peer.log_text()[-3000:]
        for peer in peers:
            assert merged_rounds(peer) == [1, 1, 1, 1], peer.log_text()[-3000:]
            assert f"reachable at /ip4/{(a if peer.name == 'island-0' else b).address}/" in peer.log_text()
    finally:
        swarm.close()


def test_islands_behind_two_nats_merge_through_a_relay_and_a_late_one_downloads_the_state(
    internet: Internet, tmp_path: Path
) -> None:
    boot = internet.public_host("boot")
    hosts = [internet.nat_host(f"n{i}") for i in range(3)]
    swarm = LocalSwarm(tmp_path, run_id="natted")
    long_run = [*ROUND, "--outer-steps", "200"]  # the test stops them once the late island has merged
    try:
        swarm.bootstrap(host=None, command_prefix=boot.prefix)
        line = printed_line(swarm)
        first = [start(swarm, f"island-{i}", hosts[i], line, *long_run, "--shard-index", str(i)) for i in range(2)]
        wait_until(lambda: all(sum(p > 0 for p in merged_rounds(peer)) >= 3 for peer in first), 240, "3 merges")
        late = start(swarm, "late", hosts[2], line, *long_run, "--shard-index", "2")
        wait_until(lambda: sum(p > 0 for p in merged_rounds(late)) >= 2 or not late.running, 240, "the late merges")
        for peer in [*first, late]:
            assert peer.running, peer.log_text()[-3000:]
            assert "not reachable from outside (behind NAT): using relay /ip4/" in peer.log_text()
        log = late.log_text()
        assert "starting from swarm state at outer step" in log, log[-3000:]
        assert sum(p > 0 for p in merged_rounds(late)) >= 2, log[-3000:]
        for peer in first:
            rounds = merged_rounds(peer)
            assert sum(p > 0 for p in rounds) >= len(rounds) - 2, (rounds, peer.log_text()[-2000:])
    finally:
        swarm.close()


def test_an_island_without_a_relay_averages_in_client_mode(internet: Internet, tmp_path: Path) -> None:
    boot, public, natted = internet.public_host("boot"), internet.public_host("pub"), internet.nat_host("n0")
    swarm = LocalSwarm(tmp_path, run_id="client")
    try:
        swarm.bootstrap(host=None, command_prefix=boot.prefix, extra_args=["--relay", "false"])
        line = printed_line(swarm)
        server = start(swarm, "public", public, line, *ROUND, "--relay", "off", "--shard-index", "0")
        client = start(swarm, "natted", natted, line, *ROUND, "--relay", "off", "--shard-index", "1")
        for peer in (server, client):
            assert peer.wait(240) == 0, peer.log_text()[-3000:]
        assert "averaging in client mode" in client.log_text() or "could not check reachability" in client.log_text()
        assert sum(p > 0 for p in merged_rounds(client)) >= 3, client.log_text()[-3000:]
    finally:
        swarm.close()
