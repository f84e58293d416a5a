"""Sharing a declared uplink among one round's direct lanes (`--uplink-mbit`).

Why: with every lane of a round sending at once, TCP alone shares an uplink badly at the time scale of a round. On
100 Mbit/s links (benchmarks/link.py, 4 islands, int8) one sender's three lanes finished 0.14 s, 0.4 s and 1.29 s
into a 1.5 s round: the late lane ran at 30 segments of window behind 20-50 ms of queue (`ss`: about 1 MB/s against
a fair share of 4 MB/s) while the sender's other lanes held the link, under BBR and CUBIC alike and with a larger
initial window. Each reducer answers part p only once every sender's part p is in, so one starved lane idled
every other uplink in turn, and rounds took 1.27-1.43x bytes/bandwidth.

What: an island that knows its upload rate paces each lane sending at the moment at an even share of it
(`UplinkShare`: Linux's SO_MAX_PACING_RATE, enforced by TCP's own pacing) and keeps little unsent data in each
socket (TCP_NOTSENT_LOWAT), so that the order it sends in is the order that leaves. It sends its own parts first
and its replies after (`OwnPartsOut`): every reducer then has all its senders' parts by the time the uplinks turn
to replies, and no uplink waits. Measured: 1.16x at 4 islands, int8, against 1.46x unpaced in the same run
(benchmarks/link.py). Lanes are paced only where the rate is given: a guess too low would cap the island below
its link.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterable

from hivemind.utils import get_logger

logger = get_logger(__name__)

SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)
"""Linux's socket option (Python's socket module does not name it)."""
PACE_FRACTION = 0.98
"""Lanes together send at this fraction of the declared rate: just under the link, so its queue stays short."""
UNSENT_S = 0.01
"""A paced socket holds about this long of its lane's traffic unsent (TCP_NOTSENT_LOWAT), at least MIN_UNSENT."""
MIN_UNSENT = 32 * 1024


def lane_rate(uplink_mbit: float, lanes: int) -> int:
    """Bytes per second for each of `lanes` lanes sending at once over an uplink of `uplink_mbit` Mbit/s."""
    return max(1, int(uplink_mbit * 1e6 / 8 * PACE_FRACTION / max(1, lanes)))


def pace_socket(sock: socket.socket, bytes_per_s: int) -> bool:
    """Pace `sock` at `bytes_per_s` and keep its unsent bytes small; False where the system has no such options."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, min(bytes_per_s, 2**32 - 1))
        unsent = max(MIN_UNSENT, int(bytes_per_s * UNSENT_S))
        sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, "TCP_NOTSENT_LOWAT", 25), unsent)
    except OSError as error:
        logger.debug(f"lanes left unpaced: {error}")
        return False
    return True


class UplinkShare:
    """The lanes sending at this moment share the declared uplink evenly: one that starts or stops sending re-paces
    the others, so that a lane done early (or one still waiting for its ticket) leaves no share of the link idle."""

    def __init__(self, uplink_mbit: float) -> None:
        self.uplink_mbit = uplink_mbit
        self._sending: set[socket.socket] = set()

    def start(self, sock: socket.socket) -> None:
        """`sock` begins to send a run of frames."""
        self._sending.add(sock)
        self._repace()

    def stop(self, sock: socket.socket) -> None:
        """`sock` has nothing more to send for now (or closed)."""
        self._sending.discard(sock)
        self._repace()

    def _repace(self) -> None:
        for sock in [sock for sock in self._sending if sock.fileno() == -1]:
            self._sending.discard(sock)
        rate = lane_rate(self.uplink_mbit, len(self._sending))
        for sock in self._sending:
            pace_socket(sock, rate)


class OwnPartsOut:
    """Whether a member's own parts have left for every remote reducer, lanes and libp2p streams alike: a paced
    member's replies wait for that (a reducer's failed or abandoned send counts as done, and so does a lost round)."""

    def __init__(self, reducers: Iterable[int]) -> None:
        self._pending = set(reducers)
        self.event = asyncio.Event()
        if not self._pending:
            self.event.set()

    def done(self, reducer: int) -> None:
        """Our parts for `reducer` are out (or will never be)."""
        self._pending.discard(reducer)
        if not self._pending:
            self.event.set()

    def release(self) -> None:
        """Stop holding anything back (the round is lost: its poisoned replies should leave at once)."""
        self._pending.clear()
        self.event.set()
