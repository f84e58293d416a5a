"""Swarms under attack, shared by benchmarks/attacks.py and tests/test_attacks.py.

Two honest islands of the tiny model and a third island, honest or hostile (`hostile_island.py`: the project's
own peer with one function replaced), or three honest islands beside records forged with a plain DHT node;
or, for donor attacks, a late honest island that must download the swarm's state with a liar among the donors.
"""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path

from lib.common import TINY

HOSTILE = str(Path(__file__).with_name("hostile_island.py"))
# --wait-for-islands 3: all three start training together, so every run (the baseline too) has the same schedule;
# an island that came up first would train rounds alone and put the others behind.
ROUNDS = ["--outer-steps", "10", "--num-shards", "3", "--target-group-size", "3", "--averaging-timeout", "20"]
ROUNDS += ["--wait-for-islands", "3"]
TAIL_ROUNDS = 3
"""An island's final eval is the mean of its last rounds' eval_loss: on these short runs one round's eval moves by
about 1% up or down, as much as the band the tests allow."""
UNDEFENDED = ["--robust-merge", "none", "--ban-rounds", "0"]
MERGE_ATTACKS = ("scale", "noise", "flip", "nan", "tokens", "clock", "random-data")
DONOR_ATTACKS = ("donor-random", "donor-nan", "donor-shape")
FORGED_RECORDS = {
    "record-step": {"outer_step": 10**9},
    "record-garbage": {"outer_step": "garbage"},
    "record-none": {"outer_step": None},
    "record-fingerprint": {"fingerprint": "0000000000000000"},
    "record-codec": {"codec": "int4"},
}
_PEER = re.compile(r"island (Qm\w+|12D3\w+) joined run")


def _peer_id(peer) -> str | None:
    records = peer.records()
    if records:
        return records[0]["peer_id"]
    match = _PEER.search(peer.log_text())
    return match.group(1) if match else None


def named(peer_id: str | None, logs: list[str]) -> bool:
    """True when some honest island's warnings name `peer_id`."""
    return bool(peer_id) and any(
        peer_id in line and ("WARN" in line or "ERROR" in line) for log in logs for line in log.splitlines()
    )


def _wait(done, timeout: float) -> None:
    """Poll `done()` (a child's metrics file or state: no event to await) until true or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(0.5)


def _summary(honest: list, attacker: str | None, started: float) -> dict:
    records = [peer.records() for peer in honest]
    logs = [peer.log_text() for peer in honest]
    round_s = [r["round_s"] for island in records for r in island[1:] if r.get("round_s")]
    return {
        "evals": [statistics.mean(r["eval_loss"] for r in island[-TAIL_ROUNDS:]) for island in records],
        "merged": [sum(r["partners"] > 0 for r in island) for island in records],
        "logs": logs,
        "attacker": attacker,
        "detected": named(attacker, logs),
        "crashed": any("Traceback" in log for log in logs),
        "round_s": statistics.mean(round_s) if round_s else None,
        "wall_s": time.monotonic() - started,
    }


def merge_attack(folder: Path, attack: str | None, *, defended: bool = True) -> dict:
    """Two honest islands and a third (hostile when `attack`), 10 outer steps."""
    from p2p_diloco.cli.launcher import LocalSwarm

    # Quorum 2: the two honest islands merge with each other every round. With quorum 1 a loaded machine leaves
    # one island alone for a round or two (merged [10, 8] in one full CI session), which moved its final eval by
    # 2.2%: noise the size of the band the tests allow, and not the attack's doing.
    extra = ["--quorum", "2"] + ([] if defended else UNDEFENDED)
    swarm = LocalSwarm(folder, run_id="attacked")
    started = time.monotonic()
    try:
        swarm.bootstrap()
        honest = [swarm.peer(f"honest-{i}", *ROUNDS, "--shard-index", str(i), *extra, config=TINY) for i in range(2)]
        program = None if attack is None else (HOSTILE, attack)
        third = swarm.peer("third", *ROUNDS, "--shard-index", "2", *extra, config=TINY, program=program)
        for peer in honest:
            if peer.wait(300) != 0:
                raise RuntimeError(f"{peer.name} failed under attack {attack}:\n{peer.log_text()[-3000:]}")
        third.wait(120)
        return _summary(honest, _peer_id(third), started)
    finally:
        swarm.close()


def donor_attack(folder: Path, attacks: str | list[str], *, defended: bool = True) -> dict:
    """Two honest islands and lying donors (one per attack) train; a late honest island joins and downloads the
    state."""
    from p2p_diloco.cli.launcher import LocalSwarm

    attacks = [attacks] if isinstance(attacks, str) else attacks
    extra = [] if defended else UNDEFENDED
    swarm = LocalSwarm(folder, run_id="donors")
    started = time.monotonic()
    shards = str(3 + len(attacks))
    # Nobody finishes on its own: a tiny island runs 12 rounds in seconds, and the late island must find the
    # swarm still there when it arrives. The run ends once the late island has trained a few rounds.
    long = ["--outer-steps", "100000", "--num-shards", shards, "--target-group-size", shards, *extra]
    try:
        swarm.bootstrap()
        honest = [swarm.peer(f"honest-{i}", *long, "--shard-index", str(i), config=TINY) for i in range(2)]
        liars = [
            swarm.peer(f"liar-{i}", *long, "--shard-index", str(2 + i), config=TINY, program=(HOSTILE, attack))
            for i, attack in enumerate(attacks)
        ]
        _wait(lambda: all(len(peer.records()) >= 4 for peer in honest), 180)  # a state worth taking
        late = swarm.peer("late", *long, "--shard-index", str(2 + len(attacks)), config=TINY)
        _wait(lambda: len(late.records()) >= 4 or not late.running, 300)
        honest_step = max(r["outer_step"] for peer in honest for r in peer.records())
        result = _summary([late, *honest], None, started)
        liar_ids = [_peer_id(liar) for liar in liars]
        result["detected"] = all(named(liar, result["logs"]) for liar in liar_ids)
        result["attacker"] = liar_ids
        result["adopted_step"] = (late.records() or [{}])[0].get("outer_step")
        result["honest_step"] = honest_step
        result["late_log"] = late.log_text()
        return result
    finally:
        swarm.close()


def forged_record(folder: Path, names: str | list[str]) -> dict:
    """Three honest islands beside records forged with plain DHT nodes, one node per record (each signed by its
    node's key, and once more unsigned with a ten-year life)."""
    from hivemind.utils import get_dht_time

    from p2p_diloco.cli.launcher import LocalSwarm
    from p2p_diloco.net.dht import shutdown_dht, start_dht
    from p2p_diloco.net.records import PROTOCOL_VERSION, RunRecords, records_key

    names = [names] if isinstance(names, str) else names
    swarm = LocalSwarm(folder, run_id="attacked")
    forgers = []
    started = time.monotonic()
    try:
        maddrs = swarm.bootstrap()
        base = {
            "protocol": PROTOCOL_VERSION,
            "version": "0.1.0",
            "fingerprint": "f",
            "codec": "fp32",
            "outer_step": 3,
            "tokens": 1,
        }
        for name in names:
            forger = start_dht(
                initial_peers=maddrs,
                host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                announce_maddrs=[],
                identity=None,
                timeout=30,
            )
            forgers.append(forger)
            peer = forger.peer_id.to_base58()
            forged = {**base, **FORGED_RECORDS[name], "peer_id": peer}
            RunRecords(forger, "attacked", peer, ttl=60, timeout=10).announce(forged, check=False)
            forger.store(
                records_key("attacked"),
                subkey=f"forged-{name}",
                value=forged,
                expiration_time=get_dht_time() + 10 * 365 * 86400,
            )
        # Quorum 3: every round merges all three, so a loss the records cause is not lost in a loaded machine's
        # partial rounds (which moved one run's final eval by 2.5% in a full test session).
        quorum = ["--quorum", "3"]
        honest = [swarm.peer(f"honest-{i}", *ROUNDS, *quorum, "--shard-index", str(i), config=TINY) for i in range(3)]
        for island in honest:
            if island.wait(300) != 0:
                raise RuntimeError(f"{island.name} failed beside records {names}:\n{island.log_text()[-3000:]}")
        result = _summary(honest, None, started)
        peers = [forger.peer_id.to_base58() for forger in forgers]
        result["attacker"], result["detected"] = peers, all(named(peer, result["logs"]) for peer in peers)
        return result
    finally:
        for forger in forgers:
            shutdown_dht(forger)
        swarm.close()
