"""A private swarm: members with owner-signed tokens train together; a stranger is refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import LocalSwarm


def keys(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "p2p_diloco", "keys", *args], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_members_train_and_strangers_are_refused(local_swarm: LocalSwarm, tmp_path: Path) -> None:
    owner = keys("new", "--out", str(tmp_path / "owner.key"))
    assert owner.startswith("ed25519:")

    def member(name: str) -> list[str]:
        identity = tmp_path / f"{name}.id"
        keys(
            "invite",
            "--owner-key",
            str(tmp_path / "owner.key"),
            "--identity",
            str(identity),
            "--expires",
            "1h",
            "--out",
            str(tmp_path / f"{name}.token"),
        )
        return [
            "--identity",
            str(identity),
            "--swarm-public-key",
            owner,
            "--membership",
            str(tmp_path / f"{name}.token"),
        ]

    local_swarm.bootstrap(extra_args=member("bootstrap"))
    args = ["--outer-steps", "5", "--num-shards", "2", "--target-group-size", "2", "--quorum", "2"]
    members = [
        local_swarm.peer(f"member-{i}", *args, "--shard-index", str(i), *member(f"member-{i}")) for i in range(2)
    ]

    # A stranger with no token, and one with another island's token, never get in.
    stranger = local_swarm.peer("stranger", *args, "--shard-index", "0")
    borrowed = [
        "--identity",
        str(tmp_path / "thief.id"),
        "--swarm-public-key",
        owner,
        "--membership",
        str(tmp_path / "member-0.token"),
    ]
    thief = local_swarm.peer("thief", *args, "--shard-index", "1", *borrowed)
    assert stranger.wait(120) == 2 and thief.wait(120) == 2
    errors = [line for line in stranger.log_text().splitlines() if "error:" in line]
    assert len(errors) == 1 and "this swarm is private" in errors[0] and owner in errors[0], stranger.log_text()[-2000:]
    errors = [line for line in thief.log_text().splitlines() if "error:" in line]
    assert len(errors) == 1 and "does not admit this island" in errors[0], thief.log_text()[-2000:]
    assert stranger.records() == [] and thief.records() == []

    for peer in members:
        assert peer.wait(240) == 0, peer.log_text()[-3000:]
        assert sum(r["partners"] > 0 for r in peer.records()) >= 3, peer.log_text()[-3000:]
    ids = {peer.records()[-1]["peer_id"] for peer in members}
    assert all(set(r["group"]) <= ids for peer in members for r in peer.records())

    # Members (and only they) can read the run.
    status = subprocess.run(
        [
            sys.executable,
            "-m",
            "p2p_diloco",
            "status",
            "--initial-peers",
            *local_swarm.maddrs,
            "--run-id",
            "test",
            "--json",
            *member("reader"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert status.returncode == 0, status.stderr
    assert {row["peer_id"] for row in json.loads(status.stdout)["islands"]} == ids
