"""Reading a swarm from outside: a client-mode DHT node that lists the runs of a DHT and the islands of a run."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from hivemind.utils import get_dht_time

from p2p_diloco.diloco.staleness import robust_clock
from p2p_diloco.net.dht import OrphanFreeDHT, shutdown_dht, start_dht
from p2p_diloco.net.records import RUNS_KEY, records_key, verified


@dataclass
class IslandView:
    """One island's record, as the DHT holds it."""

    peer_id: str
    record: dict[str, Any]
    expires_in_s: float

    def seen_s_ago(self, ttl: float) -> float:
        """Seconds since the island last announced itself (its record lives `ttl` seconds)."""
        return max(0.0, ttl - self.expires_in_s)


class Observer:
    """A DHT node that only reads (client mode: nobody routes through it or dials it)."""

    def __init__(
        self, initial_peers: list[str], *, timeout: float = 30.0, membership: Any = None, identity: str | None = None
    ):
        self.timeout = timeout
        self.dht: OrphanFreeDHT | None = start_dht(
            initial_peers=initial_peers,
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            announce_maddrs=[],
            identity=identity,
            timeout=timeout,
            client_mode=True,
            membership=membership,
        )

    def _get(self, key: str) -> dict[Any, tuple[Any, float]]:
        found = self.dht.get(key, latest=True, return_future=True).result(timeout=self.timeout)
        entries = (found.value if found is not None else None) or {}
        if not isinstance(entries, dict):
            return {}
        return {
            subkey: (item.value, item.expiration_time)
            for subkey, item in entries.items()
            if hasattr(item, "value") and hasattr(item, "expiration_time")
        }

    def runs(self) -> dict[str, dict[str, Any]]:
        """Every run registered in the DHT: run id -> what its last announcing island said."""
        return {str(run): value for run, (value, _) in self._get(RUNS_KEY).items() if isinstance(value, dict)}

    def islands(self, run_id: str) -> list[IslandView]:
        """The live islands of a run, freshest first."""
        now = get_dht_time()
        views = [
            IslandView(value["peer_id"], value, expiration - now)
            for subkey, (value, expiration) in self._get(records_key(run_id)).items()
            if verified(subkey, value, expiration, now) is None
        ]
        return sorted(views, key=lambda view: -view.expires_in_s)

    def close(self) -> None:
        """Stop the DHT node."""
        if self.dht is not None:
            shutdown_dht(self.dht)
            self.dht = None

    def __enter__(self) -> Observer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def number(value: Any) -> float | None:
    """A finite number from a record, or None (records come from peers and may hold anything)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if value == value and abs(value) != float("inf") else None


def summary(run_id: str, islands: list[IslandView], ttl: float) -> dict[str, Any]:
    """What `p2p-diloco status --json` prints: the swarm's clock and tokens, and every island's figures."""
    rows = []
    for view in islands:
        record = view.record
        rows.append(
            {
                "peer_id": view.peer_id,
                "reachability": record.get("reachability") if isinstance(record.get("reachability"), str) else None,
                "outer_step": int(number(record.get("outer_step")) or 0),
                "loss": number(record.get("loss")),
                "eval_loss": number(record.get("eval_loss")),
                "tokens": int(number(record.get("tokens")) or 0),
                "tokens_per_s": number(record.get("tokens_per_s")),
                "partners": number(record.get("partners")),
                "codec": record.get("codec") if isinstance(record.get("codec"), str) else None,
                "version": record.get("version") if isinstance(record.get("version"), str) else None,
                "protocol": number(record.get("protocol")),
                "last_seen_s": round(view.seen_s_ago(ttl), 1),
                "history": record.get("history") if isinstance(record.get("history"), list) else [],
            }
        )
    return {
        "run_id": run_id,
        "time": time.time(),
        "clock": robust_clock([row["outer_step"] for row in rows]),  # as islands judge it: no one island's word
        "total_tokens": sum(row["tokens"] for row in rows),
        "islands": rows,
    }
