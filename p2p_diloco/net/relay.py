"""A relay for islands that nothing can dial: a reverse TCP tunnel through a reachable peer, and a reachability probe.

Why not libp2p's own relay: p2pd (hivemind 1.1.12) always runs a circuit-relay-v2 instance with go-libp2p's
default limits, which resets a relayed connection after 128 KiB per direction (measured: a 125,000-byte call
passed, 135,000 bytes were reset), and its configurable 4 GiB relay only wins when the relay's reachability turns
public after start-up. Pseudo-gradients and states are megabytes, so p2p-diloco relays whole TCP connections
instead: the island behind a NAT keeps a control connection to a relay (a bootstrap, or a reachable island), the
relay opens a public port for it, and every connection to that port is spliced to a fresh connection the island
dials out to the relay, which the island splices to its own p2pd. The libp2p session runs end to end inside the
tunnel, so the relay sees only ciphertext and the peer id is still authenticated by the secure channel.

The control protocol is one JSON line per message on a TCP connection to the relay's control port:
    {"op": "reserve", "peer_id": P}  ->  {"ok": true, "port": N, "observed": IP}; later {"op": "open", "id": K}
    {"op": "attach", "id": K}        ->  raw bytes of visitor K from here on
    {"op": "probe", "port": N}       ->  {"ok": bool, "observed": IP}: can the relay dial the asker's IP:N?
The relay only ever dials the address a probe comes from, so it cannot be used to scan other hosts.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import socket
import threading
from collections.abc import Coroutine
from typing import Any

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 3.0
"""How long the relay tries to dial an asker back."""
ATTACH_TIMEOUT_S = 10.0
"""How long a visitor waits for the island to attach its half of the tunnel."""
CHUNK = 1 << 18


async def _send(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    writer.write(json.dumps(message).encode() + b"\n")
    await writer.drain()


async def _receive(reader: asyncio.StreamReader, timeout: float | None = None) -> dict[str, Any]:
    line = await asyncio.wait_for(reader.readline(), timeout)
    if not line:
        raise ConnectionError("relay connection closed")
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ConnectionError(f"relay sent {message!r}")
    return message


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()  # a half-close: the other direction may still carry data
    except (ConnectionError, OSError):
        pass


async def splice(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter], b: tuple[asyncio.StreamReader, asyncio.StreamWriter]
) -> None:
    """Copy bytes both ways until both sides are done, then close both."""
    try:
        await asyncio.gather(_pump(a[0], b[1]), _pump(b[0], a[1]))
    finally:
        for _, writer in (a, b):
            with contextlib.suppress(Exception):
                writer.close()


class _LoopThread:
    """An asyncio loop in a daemon thread, so the relay works beside a training loop that never awaits."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class RelayServer:
    """Serves reservations, tunnels and probes on a control port (run by bootstraps and reachable islands)."""

    def __init__(self, host: str = "0.0.0.0", port: int = 0, *, reservations: bool = True, max_islands: int = 64):
        self.host, self.requested_port = host, port
        self.serves_reservations = reservations
        self.max_islands = max_islands
        """False: answer probes only (a bootstrap started with --relay false)."""
        self.port: int | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._reservations: dict[str, asyncio.AbstractServer] = {}
        self._thread: _LoopThread | None = None

    def start(self) -> RelayServer:
        """Listen on the control port (a free one when 0); returns self once listening."""
        self._thread = _LoopThread("relay-server")
        self._server = self._thread.run(asyncio.start_server(self._control, self.host, self.requested_port), 10)
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info(f"relay serving on port {self.port}")
        return self

    def stop(self) -> None:
        """Close every tunnel and the control port."""
        if self._thread is not None:
            with contextlib.suppress(Exception):
                self._thread.run(self._close(), 5)
            self._thread.stop()
            self._thread = None

    async def _close(self) -> None:
        self._server.close()
        for server in self._reservations.values():
            server.close()
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def reservations(self) -> int:
        """Islands currently reachable through this relay."""
        return len(self._reservations)

    async def _control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        observed = writer.get_extra_info("peername")[0]
        try:
            message = await _receive(reader, timeout=ATTACH_TIMEOUT_S)
            op = message.get("op")
            if op == "probe":
                await _send(writer, {"ok": await self._probe(observed, message.get("port")), "observed": observed})
            elif op == "attach" and (waiting := self._waiting.pop(message.get("id"), None)) is not None:
                waiting.set_result((reader, writer))
                return  # the visitor's handler splices from here on
            elif op == "reserve" and not self.serves_reservations:
                await _send(writer, {"ok": False, "error": "this node does not relay (started with --relay false)"})
            elif op == "reserve" and isinstance(message.get("peer_id"), str):
                await self._reserve(str(message["peer_id"]), observed, reader, writer)
            else:
                await _send(writer, {"ok": False, "error": f"unknown request {op!r}"})
        except (ConnectionError, OSError, asyncio.TimeoutError, ValueError) as error:
            logger.debug(f"relay control connection from {observed}: {error!r}")
        with contextlib.suppress(Exception):
            writer.close()

    async def _probe(self, host: str, port: Any) -> bool:
        if not isinstance(port, int) or not 0 < port < 65536:
            return False
        try:
            _, probe = await asyncio.wait_for(asyncio.open_connection(host, port), PROBE_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError):
            return False
        probe.close()
        return True

    async def _reserve(self, peer_id: str, observed: str, reader, writer) -> None:
        if len(self._reservations) >= self.max_islands and peer_id not in self._reservations:
            await _send(writer, {"ok": False, "error": f"relay full ({self.max_islands} islands)"})
            return
        if (old := self._reservations.pop(peer_id, None)) is not None:
            old.close()

        async def visitor(visitor_reader, visitor_writer) -> None:
            key = next(self._ids)
            self._waiting[key] = asyncio.get_running_loop().create_future()
            try:
                await _send(writer, {"op": "open", "id": key})
                island = await asyncio.wait_for(self._waiting[key], ATTACH_TIMEOUT_S)
            except (OSError, asyncio.TimeoutError, ConnectionError):
                self._waiting.pop(key, None)
                visitor_writer.close()
                return
            await splice((visitor_reader, visitor_writer), island)

        server = await asyncio.start_server(visitor, self.host, 0)
        self._reservations[peer_id] = server
        port = server.sockets[0].getsockname()[1]
        logger.info(f"relaying island {peer_id} on port {port} (it connects from {observed})")
        try:
            await _send(writer, {"ok": True, "port": port, "observed": observed})
            await reader.read()  # the reservation lives as long as the island's control connection
        finally:
            if self._reservations.get(peer_id) is server:
                del self._reservations[peer_id]
            server.close()
            logger.info(f"island {peer_id} is no longer relayed on port {port}")


def probe(relay: tuple[str, int], port: int, timeout: float = PROBE_TIMEOUT_S + 5) -> tuple[bool, str | None]:
    """Ask a relay to dial this host back on `port`: (reachable, the IP the relay sees us at)."""
    try:
        with socket.create_connection(relay, timeout=timeout) as connection:
            connection.sendall(json.dumps({"op": "probe", "port": port}).encode() + b"\n")
            answer = json.loads(connection.makefile().readline() or "{}")
    except (OSError, ValueError):
        return False, None
    return bool(answer.get("ok")), answer.get("observed")


class RelayClient:
    """Keeps this island reachable through a relay: a reservation, and a tunnel to the local p2pd per visitor."""

    def __init__(self, relay: tuple[str, int], peer_id: str, local_port: int):
        self.relay, self.peer_id, self.local_port = relay, peer_id, local_port
        self.port: int | None = None
        """The relay's public port for this island (set once reserved)."""
        self.observed: str | None = None
        self._thread: _LoopThread | None = None
        self._task: asyncio.Task | None = None
        self._tunnels: set[asyncio.Task] = set()  # asyncio keeps only weak references to tasks

    def start(self, timeout: float = 10.0) -> int:
        """Reserve a port on the relay (raises OSError if the relay refuses or does not answer)."""
        self._thread = _LoopThread("relay-client")
        reader, writer = self._thread.run(self._reserve(), timeout)
        self._task = self._thread.run(self._spawn(self._serve(reader, writer)), 5)
        return self.port

    async def _spawn(self, coroutine: Coroutine) -> asyncio.Task:
        return asyncio.create_task(coroutine)

    def stop(self) -> None:
        """Give the reservation up and close every tunnel."""
        if self._thread is not None:
            with contextlib.suppress(Exception):
                self._thread.run(self._cancel(), 5)
            self._thread.stop()
            self._thread = None

    async def _cancel(self) -> None:
        tasks = [task for task in [self._task, *self._tunnels] if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _reserve(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(*self.relay)
        await _send(writer, {"op": "reserve", "peer_id": self.peer_id})
        answer = await _receive(reader, timeout=10.0)
        if not answer.get("ok") or not isinstance(answer.get("port"), int):
            writer.close()
            raise OSError(f"relay {self.relay[0]}:{self.relay[1]} refused: {answer.get('error', answer)}")
        self.port, self.observed = answer["port"], answer.get("observed")
        return reader, writer

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._keep_reserved(reader, writer)
        finally:
            self._writer.close()

    async def _keep_reserved(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        while True:
            try:
                while True:
                    message = await _receive(reader)
                    if message.get("op") == "open" and isinstance(message.get("id"), int):
                        task = asyncio.create_task(self._tunnel(message["id"]))
                        self._tunnels.add(task)
                        task.add_done_callback(self._tunnels.discard)
            except (ConnectionError, OSError, ValueError) as error:
                logger.warning(f"lost the relay {self.relay[0]}:{self.relay[1]} ({error!r}); reserving again")
            writer.close()
            while True:
                await asyncio.sleep(2.0)  # back off before reserving again
                try:
                    reader, writer = await self._reserve()
                    self._writer = writer
                    logger.info(f"reachable again through relay port {self.port}")
                    break
                except (OSError, ConnectionError, asyncio.TimeoutError, ValueError):
                    continue

    async def _tunnel(self, key: int) -> None:
        try:
            relay = await asyncio.open_connection(*self.relay)
            await _send(relay[1], {"op": "attach", "id": key})
            local = await asyncio.open_connection("127.0.0.1", self.local_port)
        except OSError as error:
            logger.debug(f"could not open tunnel {key}: {error!r}")
            return
        await splice(relay, local)
