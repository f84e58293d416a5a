"""The metrics line of one round (see `p2p_diloco.train.metrics` for the required keys) and its log line."""

from __future__ import annotations

import time
from typing import Any

from p2p_diloco.island.rounds import Landed


def round_record(
    *,
    peer_id: str,
    run_id: str,
    outer_step: int,
    inner_steps_total: int,
    tokens: int,
    landed: Landed,
    losses: list[float],
    steps: int,
    compute_s: float,
    round_start: float,
    anchor_digest: str,
    transport: tuple[int, int] | None,
) -> dict[str, Any]:
    """One round's metrics: what training did, and what the merge that landed in it did."""
    verdict, outcome = landed.verdict, landed.outcome
    result = verdict.result
    partners = verdict.partners
    return {
        "peer_id": peer_id,
        "run_id": run_id,
        "outer_step": outer_step,
        "inner_steps_total": inner_steps_total,
        "loss": sum(losses) / len(losses),
        "tokens": tokens,
        "partners": outcome.partners,
        "wait_s": landed.blocked_s,
        "exchange_s": landed.exchange_s,
        "bytes_sent": result.bytes_sent,
        "bytes_recv": result.bytes_recv,
        "transport_sent": None if transport is None else transport[0],
        "transport_recv": None if transport is None else transport[1],
        "time": time.time(),
        "quorum": outcome.partners + 1,
        "grace_s": result.matchmaking_s,
        "grace_window_s": result.grace_window_s,
        "merge_weights": list(verdict.weights.values()) if verdict.weights else [None],
        "staleness": [landed.staleness] + [landed.swarm_step - int(data["outer_step"]) for data in partners.values()],
        "fragment": landed.fragment,
        "inner_steps": steps,
        "compute_s": compute_s,
        "round_s": time.monotonic() - round_start,
        "group": sorted(partners),
        "merged": outcome.merged,
        "resynced": outcome.resynced,
        "note": outcome.note,
        "anchor_digest": anchor_digest,
    }


def progress_line(record: dict[str, Any], outer_steps: int) -> str:
    """The log line of one round."""
    evaluated = "-" if record["eval_loss"] is None else f"{record['eval_loss']:.4f}"
    return (
        f"outer step {record['outer_step']}/{outer_steps}: loss {record['loss']:.4f} "
        f"eval {evaluated} partners {record['partners']} wait {record['wait_s']:.2f}s "
        f"(grace window {record['grace_window_s'] or 0:.2f}s)"
        + ("" if record["fragment"] is None else f" fragment {record['fragment']}")
        + (f" ({record['note']})" if record["note"] else "")
    )
