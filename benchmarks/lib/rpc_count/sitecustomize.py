"""Counts the protobuf bytes of every hivemind RPC a process makes, for `benchmarks/chatter.py`.

Python imports `sitecustomize` at start-up from any folder on PYTHONPATH, so the chatter benchmark puts this
folder there for its islands (and their forked DHT and averager processes). With P2P_DILOCO_RPC_COUNT naming a
file, each process appends one line per finished RPC ("TIME rpc NAME KEY SENT RECEIVED", KEY the first DHT key's
id prefix, or -) and one per DHT get or store ("TIME key KIND KEY_ID NAME"), so that RPC bytes can be charged to
the DHT key they served. It wraps two methods of hivemind's P2P and two of DHTNode after their modules load: the only
way to see traffic by protocol and key without changing what the islands do (the kernel's TCP counters, which
`bandwidth.py` reports, see only the sum). Payload sent over direct lanes bypasses P2P and is not counted here.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import time

_OUT = os.environ.get("P2P_DILOCO_RPC_COUNT")


def _write(line: str) -> None:
    with open(_OUT, "a") as file:  # one short line per write: appends from several processes do not interleave
        file.write(f"{time.time():.3f} {line}\n")


def _key_prefix(message) -> str:
    keys = getattr(message, "keys", None)
    return bytes(keys[0]).hex()[:12] if keys else "-"


def _wrap_p2p(module) -> None:
    P2P = module.P2P
    unary, stream = P2P._call_unary_protobuf_handler, P2P._iterate_protobuf_stream_handler

    async def counted_unary(self, peer_id, name, request, output_type):
        response = await unary(self, peer_id, name, request, output_type)
        _write(f"rpc {name} {_key_prefix(request)} {request.ByteSize()} {response.ByteSize()}")
        return response

    async def counted_stream(self, peer_id, name, requests, output_type):
        sizes = [0, 0]

        async def sent():
            async for request in requests:
                sizes[0] += request.ByteSize()
                yield request

        responses = await stream(self, peer_id, name, sent(), output_type)

        async def received():
            try:
                async for response in responses:
                    sizes[1] += response.ByteSize()
                    yield response
            finally:
                _write(f"rpc {name} - {sizes[0]} {sizes[1]}")

        return received()

    P2P._call_unary_protobuf_handler, P2P._iterate_protobuf_stream_handler = counted_unary, counted_stream


def _wrap_node(module) -> None:
    from hivemind.dht.routing import DHTID

    node = module.DHTNode
    get_many, store_many = node.get_many, node.store_many

    def name_keys(kind: str, keys) -> None:
        for key in keys:
            _write(f"key {kind} {DHTID.generate(source=key).to_bytes().hex()[:12]} {key}")

    async def counted_get_many(self, keys, *args, **kwargs):
        name_keys("get", keys)
        return await get_many(self, keys, *args, **kwargs)

    async def counted_store_many(self, keys, *args, **kwargs):
        name_keys("store", keys)
        return await store_many(self, keys, *args, **kwargs)

    node.get_many, node.store_many = counted_get_many, counted_store_many


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a wrapper on a module right after it first executes."""

    def __init__(self, wrappers):
        self.wrappers = wrappers

    def find_spec(self, fullname, path, target=None):
        wrap = self.wrappers.get(fullname)
        if wrap is None:
            return None
        del self.wrappers[fullname]
        spec = importlib.util.find_spec(fullname)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            wrap(module)

        spec.loader.exec_module = exec_module
        return spec


if _OUT:
    sys.meta_path.insert(0, _AfterImport({"hivemind.p2p.p2p_daemon": _wrap_p2p, "hivemind.dht.node": _wrap_node}))
