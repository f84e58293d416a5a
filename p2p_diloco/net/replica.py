"""Reads and writes of a DHT key that this node holds a replica of, without walking the DHT first.

A hivemind `get(latest=True)` asks every node near the key for its whole value, and a `store` first asks the same
nodes again (its walk for the nearest nodes carries their values too) before it stores: on a 5-node swarm each
read or write of the run's island records moved four copies of every island's record, and each look-up or
declaration of a group key four more messages (`benchmarks/chatter.py`: 24.6 KB of RPCs per island and round,
where top-k's whole payload is about 30 KB on the default model). A node among the `num_replicas` nearest to a key is
itself sent every store of that key, so its own storage already holds what the walk would return: such a node
reads the key locally and stores straight to the nearest nodes its routing table knows. It does so only

- when no node it knows of is nearer to the key than `num_replicas` others (it is a replica),
- for reads, once it has walked for the key since it became a replica (values stored before that reached others,
  not it; the walk caches them here, and every later store comes here),
- not after this node's event loop stalled (SIGSTOP, swap, an overloaded machine): a peer whose request to it timed
  out dropped it from its routing table and stores past it until it is heard from again, so every key walks first;
- and not in client mode (nobody stores to a client);

and every `network_every`-th operation takes hivemind's full walk anyway, so that a node that does not know of a
nearer newcomer yet, or missed a store, is back in step within a few operations. A direct store that any target
fails falls back to the walk.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from functools import partial
from typing import Any

from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord

NETWORK_EVERY = 4
"""Every this many operations of a handle, one walks the DHT as hivemind does (repair and a fresh view)."""


_synced: set[DHTID] = set()
"""In the DHT process: keys this node holds a replica of and has walked for since it became one."""

HEARTBEAT_S = 0.5
"""How often the DHT process's event loop notes that it runs (`_beat`)."""
STALL_S = 2.0
"""A gap between heartbeats this much longer than HEARTBEAT_S counts as a stall: hivemind's DHT requests time out
after 3 s, so a peer may have dropped this node from its routing table by then."""
_heartbeat: dict[str, Any] = {"at": None, "task": None}


def _check_stall() -> None:
    """Forget which keys are in step when the event loop has not run for a stall's length, and note that it runs."""
    now, last = time.monotonic(), _heartbeat["at"]
    if last is not None and now - last > HEARTBEAT_S + STALL_S:
        _synced.clear()
    _heartbeat["at"] = now


async def _beat() -> None:
    while True:
        _check_stall()
        await asyncio.sleep(HEARTBEAT_S)


def _forget_if_stalled() -> None:
    """After a stall, no key counts as in step until it walked again (the heartbeat starts on first use)."""
    _check_stall()
    task = _heartbeat["task"]
    if task is None or task.done():
        _heartbeat["task"] = asyncio.create_task(_beat())


def _fold_cache(node: DHTNode, key_id: DHTID) -> None:
    """Merge what walks cached of a key into this replica's storage, newest entry per subkey.

    hivemind caches a walk's result only when it is newer as a whole than the stored value, and a read that stops
    at the first live value (`latest=False`) sees the storage alone: an island's own fresh record in storage hid
    the other islands' newer records that its last walk found.
    """
    cached = node.protocol.cache.get(key_id)
    if cached is None:
        return
    stored = node.protocol.storage.get(key_id)
    if isinstance(cached.value, DictionaryDHTValue):
        for subkey, (value, expiration) in cached.value.items():
            node.protocol.storage.store(key_id, value, expiration, subkey=subkey)
    elif stored is None or not isinstance(stored.value, DictionaryDHTValue):
        node.protocol.storage.store(key_id, cached.value, cached.expiration_time)


def averager_walk_every(walk_every: int) -> int:
    """An averager looks up and declares group keys several times a round: twice the ops between walks (1 stays 1)."""
    return walk_every if walk_every == 1 else 2 * walk_every


def holds_replica(node: DHTNode, key_id: DHTID) -> bool:
    """Whether fewer than `num_replicas` nodes this node knows are nearer to `key_id` than itself."""
    if node.protocol.client_mode:
        return False
    mine = key_id.xor_distance(node.node_id)
    known = node.protocol.routing_table.get_nearest_neighbors(key_id, node.num_replicas, exclude=node.node_id)
    return sum(key_id.xor_distance(other) < mine for other, _ in known) < node.num_replicas


async def replica_get(_dht: Any, node: DHTNode, *, key: Any, network: bool) -> Any:
    """`DHT.get(key, latest=True)`, answered from this node's own storage when it is a replica in step with it."""
    key_id = DHTID.generate(source=key)
    _forget_if_stalled()
    replica = holds_replica(node, key_id)
    if network or not replica or key_id not in _synced:
        found = await node.get(key, latest=True)  # merged into storage, or cached: `_fold_cache`
        if replica:
            _synced.add(key_id)
        else:
            _synced.discard(key_id)
        return found
    if node.protocol.storage.get(key_id) is None and node.protocol.cache.get(key_id) is None:
        return None  # every live value of the key would have been stored here: there is none
    _fold_cache(node, key_id)
    # latest=False finishes at the first live value, and the node's own storage and cache are checked first.
    return await node.get(key, latest=False)


async def replica_store(
    _dht: Any, node: DHTNode, *, key: Any, value: Any, expiration_time: float, subkey: Any, network: bool
) -> bool:
    """`DHT.store`, sent straight to the nearest nodes this node knows when it is a replica of the key."""
    key_id = DHTID.generate(source=key)
    if network or not holds_replica(node, key_id):
        return await node.store(key, value, expiration_time, subkey=subkey)
    protocol = node.protocol
    # As hivemind's DHTNode.store_many signs and stores one item, less its walk for the nearest nodes: hivemind has
    # no option to store to nodes already known (the walk's find requests return the key's whole value).
    record = DHTRecord(
        key_id.to_bytes(), protocol.serializer.dumps(subkey), protocol.serializer.dumps(value), expiration_time
    )
    if protocol.record_validator is not None:
        record = dataclasses.replace(record, value=protocol.record_validator.sign_value(record))
        if not protocol.record_validator.validate(record):
            return False
    others = protocol.routing_table.get_nearest_neighbors(key_id, node.num_replicas - 1, exclude=node.node_id)
    stored = protocol.storage.store(key_id, record.value, expiration_time, subkey=subkey)
    replies = await asyncio.gather(
        *(
            protocol.call_store(
                peer, keys=[key_id], values=[record.value], expiration_time=[expiration_time], subkeys=[subkey]
            )
            for _, peer in others
        )
    )
    answered = bool(stored) and all(all(reply) for reply in replies if reply is not None)
    if any(reply is None for reply in replies):
        # A target did not answer: the walk finds the nearest live nodes. Those that took the store already refuse
        # it again (hivemind stores a value only over an older one), so its own verdict alone would read False.
        return await node.store(key, value, expiration_time, subkey=subkey) or answered
    return answered


class ReplicaFirstDHT:
    """A DHT handle whose `get(latest=True)` and `store` use `replica_get` and `replica_store` (every other call,
    and every `network_every`-th of these, as hivemind's)."""

    def __init__(self, dht: Any, *, network_every: int = NETWORK_EVERY):
        self._dht, self.network_every = dht, network_every
        self.operations: dict[tuple[str, Any], int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dht, name)

    def _network(self, kind: str, key: Any) -> bool:
        """Whether this read or write walks: every network_every-th of its kind and key, a read first (counted per
        kind and key: an announce's read, stores and relay store must not fall into step)."""
        done = self.operations.get((kind, key), 0)
        self.operations[(kind, key)] = done + 1
        return (done if kind == "get" else done + 1) % self.network_every == 0

    def get(self, key: Any, latest: bool = False, return_future: bool = False, **kwargs: Any) -> Any:
        """As `hivemind.DHT.get`; a latest read without extra options may be answered by this node's replica."""
        if not latest or kwargs:
            return self._dht.get(key, latest=latest, return_future=return_future, **kwargs)
        call = partial(replica_get, key=key, network=self._network("get", key))
        return self._dht.run_coroutine(call, return_future=return_future)

    def store(
        self,
        key: Any,
        value: Any,
        expiration_time: float,
        subkey: Any = None,
        return_future: bool = False,
        **kwargs: Any,
    ) -> Any:
        """As `hivemind.DHT.store`; sent straight to the nearest known nodes when this node is a replica."""
        if kwargs:
            return self._dht.store(key, value, expiration_time, subkey=subkey, return_future=return_future, **kwargs)
        call = partial(
            replica_store,
            key=key,
            value=value,
            expiration_time=expiration_time,
            subkey=subkey,
            network=self._network("store", key),
        )
        return self._dht.run_coroutine(call, return_future=return_future)
