"""One direct lane (`p2p_diloco.net.direct` opens them): AES-GCM sealed frames over one TCP connection, both ways.

Liveness: each end sends a sealed heartbeat whenever it has sent nothing for HEARTBEAT_S, and a read that hears
nothing, not even a heartbeat, for SILENCE_S ends the lane. A frozen island (SIGSTOP, a stalled VM) keeps its TCP
connections open, as its kernel still acknowledges, so without this its partners waited out the chunk timeouts:
an 8 s freeze held a 5-island group 8.3 s, and 4.5 s with heartbeats (benchmarks/chaos.py). A reducer waiting on
a slow third member sends heartbeats meanwhile, so only a silent peer is given up on.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

TAG_BYTES = 16
FRAME = struct.Struct("<IBQd")  # part index, payload kind, payload length, sender's weight
RAW_FP32 = 0
"""Payload kind: the part's float32 values, little-endian."""
PROTOBUF = 1
"""Payload kind: a serialized hivemind runtime_pb2.Tensor (a compressed part)."""
HEARTBEAT = 2
"""Frame kind: no payload, the part index field counts heartbeats (their nonces are apart from the parts')."""
HEARTBEAT_S = 0.5
"""A lane end that has sent nothing for this long sends a heartbeat."""
SILENCE_S = 3.0
"""A read that hears nothing from the other end for this long ends the lane (six heartbeats missed: a loaded
2-core host throttles a 0.4-core island for at most tens of milliseconds at a time)."""
TO_REDUCER, TO_SENDER = 0, 1


class LaneError(ConnectionError):
    """A lane broke: closed, a frame out of order or too large, or a frame that failed its tag."""


class LaneSilent(LaneError):
    """The other end sent nothing, not even a heartbeat, for SILENCE_S: it is frozen or cut off."""


class Lane:
    """One open connection between a sender and a reducer: frames sealed with AES-GCM in both directions."""

    def __init__(
        self, sock: socket.socket, key: bytes, *, outgoing: int, heartbeat_s: float = HEARTBEAT_S, silence_s=SILENCE_S
    ) -> None:
        self.sock, self.aead, self.outgoing = sock, AESGCM(key), outgoing
        self.loop = asyncio.get_running_loop()
        self.bytes_sent = self.bytes_received = 0
        self.heartbeat_s, self.silence_s = heartbeat_s, silence_s
        self._header = bytearray(FRAME.size)
        # Reused for every frame: fresh buffers per part cost more in page faults than the copies themselves.
        self._outgoing_frame = torch.empty(0, dtype=torch.uint8)
        self._sealed = torch.empty(0, dtype=torch.uint8)
        self._sending = asyncio.Lock()  # a heartbeat must not land inside a frame
        self._last_sent = self.loop.time()
        self._beats_sent = self._beats_received = 0
        self._beating = self.loop.create_task(self._beat())

    def _nonce(self, direction: int, part_index: int) -> bytes:
        return bytes([direction]) + part_index.to_bytes(4, "little") + bytes(7)

    def _beat_nonce(self, direction: int, count: int) -> bytes:
        return bytes([direction | 2]) + (count & 0xFFFFFFFF).to_bytes(4, "little") + bytes(7)

    async def send(self, part_index: int, kind: int, payload: memoryview | bytes, weight: float = 0.0) -> int:
        """Seal and send one frame; the payload bytes it carried."""
        length = len(payload)
        header = FRAME.pack(part_index, kind, length, weight)
        async with self._sending:
            self._outgoing_frame = _at_least(self._outgoing_frame, FRAME.size + length + TAG_BYTES)
            frame = memoryview(self._outgoing_frame.numpy())[: FRAME.size + length + TAG_BYTES]
            frame[: FRAME.size] = header
            _seal_into(self.aead, self._nonce(self.outgoing, part_index), payload, header, frame[FRAME.size :])
            await self.loop.sock_sendall(self.sock, frame)
            self._last_sent = self.loop.time()
        self.bytes_sent += len(frame)
        return length

    async def _beat(self) -> None:
        """Send a heartbeat whenever nothing else was sent for heartbeat_s, until the lane closes."""
        try:
            while True:
                await asyncio.sleep(max(self._last_sent + self.heartbeat_s - self.loop.time(), 0.01))
                if self._sending.locked() or self.loop.time() - self._last_sent < self.heartbeat_s:
                    continue  # a frame is on its way: the other end hears that
                header = FRAME.pack(self._beats_sent & 0xFFFFFFFF, HEARTBEAT, 0, 0.0)
                beat = header + self.aead.encrypt(self._beat_nonce(self.outgoing, self._beats_sent), b"", header)
                async with self._sending:
                    await self.loop.sock_sendall(self.sock, beat)
                    self._last_sent = self.loop.time()
                self._beats_sent += 1
                self.bytes_sent += len(beat)
        except (OSError, RuntimeError):  # the lane closed under it; its readers report that
            return

    async def _heard_beat(self, count: int, length: int) -> None:
        """Check the heartbeat whose header was just read: in order, empty, sealed with the lane's key."""
        if count != self._beats_received & 0xFFFFFFFF or length != 0:
            raise LaneError(f"heartbeat {count} ({length} bytes); expected heartbeat {self._beats_received}")
        tag = bytearray(TAG_BYTES)
        await self._read_into(memoryview(tag))
        try:
            self.aead.decrypt(
                self._beat_nonce(1 - self.outgoing, self._beats_received), bytes(tag), bytes(self._header)
            )
        except InvalidTag:
            raise LaneError(f"heartbeat {count} failed its authentication tag") from None
        self._beats_received += 1
        self.bytes_received += FRAME.size + TAG_BYTES

    async def _next_header(self) -> tuple[int, int, int, float]:
        """The next frame's header, heartbeats checked and skipped."""
        while True:
            await self._read_into(memoryview(self._header))
            index, kind, length, weight = FRAME.unpack(self._header)
            if kind != HEARTBEAT:
                return index, kind, length, weight
            await self._heard_beat(index, length)

    async def receive(
        self, part_index: int, max_length: int, into: torch.Tensor | None = None
    ) -> tuple[int, float, torch.Tensor]:
        """The next frame, which must be part `part_index` of at most `max_length` bytes: (kind, weight, payload as a
        uint8 tensor: the front of `into` if given, else a new tensor)."""
        index, kind, length, weight = await self._next_header()
        if index != part_index or length > max_length or kind not in (RAW_FP32, PROTOBUF):
            raise LaneError(f"frame of part {index} ({length} bytes, kind {kind}); expected part {part_index}")
        self._sealed = _at_least(self._sealed, length + TAG_BYTES)
        sealed = memoryview(self._sealed.numpy())[: length + TAG_BYTES]
        await self._read_into(sealed)
        fits = into is not None and into.numel() >= length
        payload = into[:length] if fits else torch.empty(length, dtype=torch.uint8)
        try:
            nonce = self._nonce(1 - self.outgoing, part_index)
            _open_into(self.aead, nonce, sealed, bytes(self._header), memoryview(payload.numpy()))
        except InvalidTag:
            raise LaneError(f"part {part_index} failed its authentication tag") from None
        self.bytes_received += FRAME.size + len(sealed)
        return kind, weight, payload

    async def _read_into(self, view: memoryview) -> None:
        await read_exactly(self.loop, self.sock, view, self.silence_s, self._fall_silent)

    def _fall_silent(self) -> None:
        # A send blocked on the silent end (its receive window full) fails at once rather than at its own timeout.
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    async def wait_closed(self) -> None:
        """Wait until the peer closes its end (a sender does once it holds every averaged part), heartbeats
        skipped."""
        while True:
            first = memoryview(self._header)[:1]
            async with _silence_bound(self.loop, self.silence_s, self._fall_silent):
                try:
                    if await self.loop.sock_recv_into(self.sock, first) == 0:
                        return
                except ConnectionResetError:  # closed with our last heartbeats unread: a close all the same
                    return
            await self._read_into(memoryview(self._header)[1:])
            index, kind, length, _ = FRAME.unpack(self._header)
            if kind != HEARTBEAT:
                raise LaneError("data after the last frame")
            await self._heard_beat(index, length)

    def close(self) -> None:
        """Close the connection (the peer's next read ends)."""
        self._beating.cancel()
        try:
            self.sock.close()
        except OSError:
            pass


def _at_least(buffer: torch.Tensor, size: int) -> torch.Tensor:
    return buffer if buffer.numel() >= size else torch.empty(size, dtype=torch.uint8)


class _silence_bound:
    """An `asyncio.timeout_at` that raises LaneSilent (after calling `on_silence`) when `seconds` pass with no bytes;
    `heard()` restarts it. None: no bound."""

    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: float | None, on_silence=None) -> None:
        self.loop, self.seconds, self.on_silence = loop, seconds, on_silence
        self._timeout = asyncio.timeout_at(None if seconds is None else loop.time() + seconds)

    def heard(self) -> None:
        if self.seconds is not None:
            self._timeout.reschedule(self.loop.time() + self.seconds)

    async def __aenter__(self) -> _silence_bound:
        await self._timeout.__aenter__()
        return self

    async def __aexit__(self, kind, error, traceback) -> None:
        try:
            await self._timeout.__aexit__(kind, error, traceback)
        except TimeoutError:
            if self.on_silence is not None:
                self.on_silence()
            raise LaneSilent(f"nothing heard for {self.seconds:g} s: the other end is frozen or cut off") from None


async def read_exactly(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    view: memoryview,
    silence_s: float | None = None,
    on_silence=None,
) -> None:
    """Fill `view` from `sock`; LaneSilent (after `on_silence()`) once `silence_s` pass with no bytes."""
    async with _silence_bound(loop, silence_s, on_silence) as bound:
        while view:
            received = await loop.sock_recv_into(sock, view)
            if received == 0:
                raise LaneError("the lane closed")
            bound.heard()
            view = view[received:]


def _seal_into(aead: AESGCM, nonce: bytes, payload: Any, header: bytes, out: memoryview) -> None:
    if hasattr(aead, "encrypt_into"):  # cryptography >= 45: no intermediate copy
        aead.encrypt_into(nonce, payload, header, out)
    else:
        out[:] = aead.encrypt(nonce, bytes(payload), header)


def _open_into(aead: AESGCM, nonce: bytes, sealed: Any, header: bytes, out: memoryview) -> None:
    if hasattr(aead, "decrypt_into"):
        aead.decrypt_into(nonce, sealed, header, out)
    else:
        out[:] = aead.decrypt(nonce, bytes(sealed), header)
