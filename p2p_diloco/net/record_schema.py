"""What an island's record in the DHT may hold: types and ranges, checked on every read.

Anyone can write into a public DHT, so every record is checked before use; a record that fails is dropped and
counted, never trusted in part. Records also live a bounded time: one that claims to expire far in the future is
not a live island's (`MAX_EXPIRATION_S`).
"""

from __future__ import annotations

import math
from typing import Any

MAX_EXPIRATION_S = 600.0
"""No record of a live island expires further ahead than this (islands renew theirs every round)."""
MAX_STEP = 10**9
MAX_ADDRESSES = 8
MAX_HISTORY = 32

_TEXT = {"fingerprint": 64, "codec": 16, "version": 32, "reachability": 16, "peer_id": 128}
_NUMBERS = {"step_time_s": (0.0, 86400.0), "loss": (-1e6, 1e6), "eval_loss": (-1e6, 1e6), "tokens_per_s": (0.0, 1e12)}


def _is_int(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_number(value: Any, low: float, high: float) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value) and low <= value <= high


def problem(record: Any) -> str | None:
    """Why an island record cannot be used (None: it can)."""
    if not isinstance(record, dict):
        return f"a {type(record).__name__}, not a record"
    for key, limit in _TEXT.items():
        value = record.get(key)
        if value is not None and not (isinstance(value, str) and len(value) <= limit):
            return f"{key} is {value!r}"
    if not isinstance(record.get("fingerprint"), str) or not isinstance(record.get("codec"), str):
        return "no model fingerprint or codec"
    if not _is_int(record.get("protocol"), 0, 10**6):
        return f"protocol is {record.get('protocol')!r}"
    if not _is_int(record.get("outer_step"), 0, MAX_STEP):
        return f"outer_step is {record.get('outer_step')!r}"
    if not _is_int(record.get("tokens", 0), 0, 10**18):
        return f"tokens is {record.get('tokens')!r}"
    if record.get("partners") is not None and not _is_int(record.get("partners"), 0, 10**6):
        return f"partners is {record.get('partners')!r}"
    for key, (low, high) in _NUMBERS.items():
        value = record.get(key)
        if value is not None and not _is_number(value, low, high):
            return f"{key} is {value!r}"
    if not isinstance(record.get("leaving", False), bool):
        return f"leaving is {record.get('leaving')!r}"
    maddrs = record.get("maddrs", [])
    if (
        not isinstance(maddrs, list)
        or len(maddrs) > MAX_ADDRESSES
        or not all(isinstance(m, str) and len(m) <= 300 for m in maddrs)
    ):
        return "maddrs is not a short list of multiaddrs"
    history = record.get("history", [])
    if not isinstance(history, list) or len(history) > MAX_HISTORY or not all(isinstance(h, list) for h in history):
        return "history is not a short list of rounds"
    return None
