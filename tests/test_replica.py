"""Replica-first DHT reads and writes (net/replica.py) on real hivemind DHT nodes and p2pd daemons on loopback."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from functools import partial

import hivemind
import pytest
from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time

from p2p_diloco.net.replica import HEARTBEAT_S, STALL_S, ReplicaFirstDHT


async def _count_walk_requests(_dht, node) -> None:
    """In the DHT process: count the find requests this node sends (what a walk is made of)."""
    protocol, send = node.protocol, node.protocol.call_find
    node.finds_sent = 0

    async def counted(peer, keys):
        node.finds_sent += 1
        return await send(peer, keys)

    protocol.call_find = counted


async def _finds_sent(_dht, node) -> int:
    return node.finds_sent


def walks(dht: hivemind.DHT, operation, *args, **kwargs):
    """(result of `operation(*args, **kwargs)`, find requests the node of `dht` sent meanwhile)."""
    before = dht.run_coroutine(_finds_sent)
    result = operation(*args, **kwargs)
    return result, dht.run_coroutine(_finds_sent) - before


@pytest.fixture
def swarm() -> Iterator[list[hivemind.DHT]]:
    """Four DHT nodes that know each other: every node is one of the num_replicas (5) nearest to any key."""
    first = hivemind.DHT(start=True, cache_refresh_before_expiry=0)
    nodes = [first]
    try:
        maddrs = [str(m) for m in first.get_visible_maddrs()]
        nodes += [hivemind.DHT(initial_peers=maddrs, start=True, cache_refresh_before_expiry=0) for _ in range(3)]
        for node in nodes:  # every node contacts every other: all routing tables are whole
            node.store("hello", subkey=str(node.peer_id), value=1, expiration_time=get_dht_time() + 60)
        nodes[0].run_coroutine(_count_walk_requests)
        yield nodes
    finally:
        for node in nodes:
            node.shutdown()


def subkeys(found) -> set:
    return set(found.value) if found is not None else set()


def test_a_replica_reads_locally_once_in_step_and_sees_stores_made_elsewhere(swarm: list[hivemind.DHT]) -> None:
    mine, other, third = swarm[0], swarm[1], swarm[2]
    replicas = ReplicaFirstDHT(mine, network_every=4)
    other.store("run.islands", subkey="b", value={"step": 1}, expiration_time=get_dht_time() + 30)
    found, requests = walks(mine, lambda: replicas.get("run.islands", latest=True))
    assert subkeys(found) == {"b"} and requests > 0, "the first read must walk: values stored before are elsewhere"
    third.store("run.islands", subkey="c", value={"step": 2}, expiration_time=get_dht_time() + 30)
    other.store("run.islands", subkey="b", value={"step": 3}, expiration_time=get_dht_time() + 31)
    for _ in range(3):
        found, requests = walks(mine, lambda: replicas.get("run.islands", latest=True, return_future=True).result(10))
        assert requests == 0, "a replica in step must answer from its own storage"
        assert subkeys(found) == {"b", "c"} and found.value["b"].value == {"step": 3}, found
    _, requests = walks(mine, lambda: replicas.get("run.islands", latest=True))
    assert requests > 0, "every network_every-th read must walk again"
    assert walks(mine, lambda: replicas.get("run.nothing", latest=True))[0] is None


def test_a_replica_stores_straight_to_the_nearest_nodes_and_others_read_it(swarm: list[hivemind.DHT]) -> None:
    mine, other = swarm[0], swarm[1]
    replicas = ReplicaFirstDHT(mine, network_every=4)
    for index in range(3):
        stored, requests = walks(mine, replicas.store, "run.0b", True, get_dht_time() + 30, subkey=f"p{index}")
        assert stored is True and requests == 0, "a replica's store must not walk"
    # Every node holds it: a read that stops at the first node with a value (latest=False) finds all three.
    for node in swarm[1:]:
        assert subkeys(node.get("run.0b", latest=False)) == {"p0", "p1", "p2"}
    stored, requests = walks(mine, lambda: replicas.store("run.0b", True, get_dht_time() + 30, subkey="p3"))
    assert stored is True and requests > 0, "every network_every-th store must walk"
    assert subkeys(other.get("run.0b", latest=True)) == {"p0", "p1", "p2", "p3"}


def test_a_direct_store_that_a_node_misses_falls_back_to_the_walk(swarm: list[hivemind.DHT]) -> None:
    mine, gone = swarm[0], swarm.pop(3)
    gone.shutdown()
    replicas = ReplicaFirstDHT(mine, network_every=100)
    stored, requests = walks(mine, lambda: replicas.store("run.islands", {"step": 1}, get_dht_time() + 30, "a"))
    assert stored is True and requests > 0, "a target that does not answer must send the store through the walk"
    assert subkeys(swarm[1].get("run.islands", latest=True)) == {"a"}


def test_other_calls_and_attributes_go_to_the_dht_itself(swarm: list[hivemind.DHT]) -> None:
    replicas = ReplicaFirstDHT(swarm[0])
    assert replicas.peer_id == swarm[0].peer_id
    swarm[1].store("plain", value=7, expiration_time=get_dht_time() + 30)
    assert replicas.get("plain").value == 7  # latest=False: hivemind's own read


def test_a_client_mode_node_always_walks() -> None:
    first = hivemind.DHT(start=True)
    client = None
    try:
        maddrs = [str(m) for m in first.get_visible_maddrs()]
        client = hivemind.DHT(initial_peers=maddrs, client_mode=True, start=True)
        client.run_coroutine(_count_walk_requests)
        replicas = ReplicaFirstDHT(client, network_every=100)
        for index in range(2):
            stored, requests = walks(client, replicas.store, "k", index, get_dht_time() + 30, f"s{index}")
            assert stored is True and requests > 0, "nobody stores to a client: its stores must walk"
            found, requests = walks(client, lambda: replicas.get("k", latest=True))
            assert requests > 0 and len(found.value) == index + 1
    finally:
        if client is not None:
            client.shutdown()
        first.shutdown()


def test_walking_every_operation_is_hiveminds_way(swarm: list[hivemind.DHT]) -> None:
    mine = swarm[0]
    replicas = ReplicaFirstDHT(mine, network_every=1)  # --dht-walk-every 1
    for index in range(3):
        assert walks(mine, replicas.store, "run.islands", index, get_dht_time() + 30, f"s{index}")[1] > 0
        assert walks(mine, replicas.get, "run.islands", latest=True)[1] > 0


async def _cache_only(_dht, node, *, key: str, subkey: str, value, expiration: float) -> None:
    """In the DHT process: what a walk that found a newer entry elsewhere leaves when it caches the key's value."""
    dumps = node.protocol.serializer.dumps
    node.protocol.cache.store(DHTID.generate(source=key), dumps(value), expiration, subkey=subkey)


def test_a_local_read_sees_what_a_walk_cached_beside_this_islands_own_newer_record(swarm: list[hivemind.DHT]) -> None:
    mine = swarm[0]
    replicas = ReplicaFirstDHT(mine, network_every=100)
    assert replicas.get("run.islands", latest=True) is None  # walked: in step
    assert replicas.store("run.islands", {"step": 1}, get_dht_time() + 60, subkey="a")
    mine.run_coroutine(
        partial(_cache_only, key="run.islands", subkey="b", value={"step": 2}, expiration=get_dht_time() + 30)
    )
    found, requests = walks(mine, lambda: replicas.get("run.islands", latest=True))
    assert requests == 0 and subkeys(found) == {"a", "b"}, found


def test_after_its_dht_process_stalled_a_replica_walks_before_it_reads_locally(swarm: list[hivemind.DHT]) -> None:
    mine, other = swarm[0], swarm[1]
    replicas = ReplicaFirstDHT(mine, network_every=100)
    replicas.get("run.islands", latest=True)
    assert walks(mine, lambda: replicas.get("run.islands", latest=True))[1] == 0  # in step
    os.kill(mine.pid, signal.SIGSTOP)  # peers' requests to it time out meanwhile: they may drop it
    try:
        time.sleep(HEARTBEAT_S + STALL_S + 1.0)  # the stall itself, not a wait for an event
    finally:
        os.kill(mine.pid, signal.SIGCONT)
    other.store("run.islands", subkey="b", value={"step": 5}, expiration_time=get_dht_time() + 30)
    found, requests = walks(mine, lambda: replicas.get("run.islands", latest=True))
    assert requests > 0 and subkeys(found) == {"b"}, "a stalled node's storage may have missed stores: walk first"
    assert walks(mine, lambda: replicas.get("run.islands", latest=True))[1] == 0  # in step again
