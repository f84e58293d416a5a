"""What an island tells the swarm about its progress: the latest figures and a short history of rounds."""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import Any

from p2p_diloco import __version__
from p2p_diloco.net.record_schema import MAX_HISTORY
from p2p_diloco.net.records import PROTOCOL_VERSION

logger = logging.getLogger(__name__)

MIN_HISTORY = 8
"""Fewest rounds kept in an island's record. The record carries twice the rounds between its announces (at least
this many), so a reader polling between announces (the dashboard) sees every round, stitched across reads: each
announce sends the record to every replica and every read fetches all of them, and 24 rounds of history were 62%
of a record's msgpack bytes (`benchmarks/bandwidth.py`: announces were a third of the chatter per round)."""


def history_rounds(announce_every: int) -> int:
    """Rounds of history an island announcing every `announce_every` rounds keeps in its record."""
    return min(MAX_HISTORY, max(MIN_HISTORY, 2 * announce_every))


CUT_OFF_WARNING_ROUNDS = 5
"""Warn every this many rounds an island spends alone while others of its run are announced."""


def _rounded(value: Any, digits: int = 4) -> Any:
    return round(value, digits) if isinstance(value, float) else value


class Progress:
    """Recent rounds of one island, from its metrics records."""

    def __init__(self, run_id: str, history: int = MIN_HISTORY) -> None:
        self.run_id = run_id
        self.rounds: deque[dict[str, Any]] = deque(maxlen=history)
        self._tokens_per_s: float | None = None
        self._alone = 0
        self._warned: set[tuple[str, str]] = set()

    def add(self, record: dict[str, Any]) -> None:
        """Remember one round's metrics."""
        if self.rounds and record.get("round_s"):
            gained = record["tokens"] - self.rounds[-1]["tokens"]
            self._tokens_per_s = gained / record["round_s"] if gained > 0 else self._tokens_per_s
        self.rounds.append(
            {
                "outer_step": record["outer_step"],
                "loss": _rounded(record.get("loss")),
                "eval_loss": _rounded(record.get("eval_loss")),
                "partners": record.get("partners", 0),
                "merged": bool(record.get("merged")),
                "resynced": bool(record.get("resynced")),
                "bytes": int((record.get("bytes_sent") or 0) + (record.get("bytes_recv") or 0)),
                "time": round(record.get("time", 0.0), 2),
                "tokens": record["tokens"],
            }
        )

    def announcement(self, identity: dict[str, Any], outer_step: int, trainer: Any, reachability: Any) -> dict:
        """An island's record in the run: who it is, where it is, its recent rounds (bounded to a few KB)."""
        return {
            "protocol": PROTOCOL_VERSION,
            "version": __version__,
            **identity,
            "outer_step": outer_step,
            "step_time_s": trainer.step_time_s,
            "maddrs": [] if reachability is None else reachability.maddrs[:4],
            "reachability": None if reachability is None else reachability.mode,
            "tokens": trainer.tokens,
            "time": time.time(),
            **self.latest(),
            "history": self.history(),
        }

    def latest(self) -> dict[str, Any]:
        """The last round's loss, eval loss and partners, and the recent tokens per second."""
        last = self.rounds[-1] if self.rounds else {}
        return {
            "loss": last.get("loss"),
            "eval_loss": last.get("eval_loss"),
            "partners": last.get("partners"),
            "tokens_per_s": _rounded(self._tokens_per_s, 1),
        }

    def history(self) -> list[list[Any]]:
        """[outer step, eval loss, partners, merged, resynced, bytes, time] per recent round, oldest first."""
        return [
            [r["outer_step"], r["eval_loss"], r["partners"], r["merged"], r["resynced"], r["bytes"], r["time"]]
            for r in self.rounds
        ]

    def warn_once(self, peer: str, what: str) -> None:
        """Name an island that announced something impossible, once per island and kind."""
        if (peer, what) not in self._warned:
            self._warned.add((peer, what))
            logger.warning(f"island {peer} {what}")

    def cut_off(self, record: dict[str, Any], link: Any, swarm_view: dict[str, dict[str, Any]]) -> str | None:
        """A warning every few rounds in which islands of the run are announced but none averaged with us."""
        alone = link.online and record["partners"] == 0 and not record["resynced"] and bool(swarm_view)
        self._alone = self._alone + 1 if alone else 0
        if not self._alone or self._alone % CUT_OFF_WARNING_ROUNDS:
            return None
        kinds = sorted({str(info.get("reachability")) for info in swarm_view.values()})
        own = link.reachability.mode if link.reachability is not None else "unknown"
        return (
            f"{len(swarm_view)} other islands of run {self.run_id!r} are announced ({', '.join(kinds)}), but none "
            f"averaged with this island in the last {self._alone} rounds; check that they can reach each other: this "
            f"island is {own} (try --relay only, --announce-maddrs with a forwarded port, or a longer "
            "--averaging-timeout on a slow link)"
        )


def startup_times(
    connecting: float,
    restoring: float,
    join_s: float,
    took_over: float | None = None,
    anchor_s: float | None = None,
) -> dict[str, float | None]:
    """Where a (re)start's time went before its first round, for that round's record (monotonic clock inputs).

    process_start_s: from the process's creation (a standby: its takeover, `took_over`) to joining (interpreter,
    imports, model, data); join_s: the DHT, reachability, announcement and averager; restore_s: the checkpoint or
    the swarm's state (download included); anchor_s: when the island trained on the swarm's anchor while the rest
    of the state downloaded, how far into restore_s its training started (else None).
    """
    restored = time.monotonic()
    age = process_age_s() if took_over is None else restored - took_over
    return {
        "process_start_s": max(0.0, age - (restored - connecting)),
        "join_s": join_s,
        "restore_s": restored - restoring,
        "anchor_s": anchor_s,
    }


def process_age_s() -> float:
    """Seconds since this process was created, to a clock tick: psutil's create_time adds a boot time rounded to
    the second, which put a restart's start-up phases up to a second off (chaos.py's breakdown)."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, after pid and comm
            return float(uptime.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):  # not Linux
        import psutil

        return time.time() - psutil.Process().create_time()
