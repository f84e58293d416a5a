"""One member of a test averaging group that runs one real averaging round per codec, each in its own run.

Protocol on stdout: "READY <maddr>"; then for each round given as LABEL:CODEC:SIZE, "PREPARED <label>" once its
averager is up, and after a line "GO" on stdin, "RESULT <json>". The merged vector (if any) is saved to
<out>/<label>-<seed>.pt so that the test can compare members bit for bit and against the true mean.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from exchange_member import member_vector

from p2p_diloco.net.codecs import describe_strangers, get_compression, strangers
from p2p_diloco.net.dht import shutdown_dht, start_dht
from p2p_diloco.net.exchange import GossipExchange


def round_vector(seed: int, size: int, label: str) -> torch.Tensor:
    """The pseudo-gradient member `seed` contributes in round `label` (the test recomputes it)."""
    return member_vector(seed * 1000 + sum(label.encode()), size)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--group-size", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", nargs="+", required=True, help="LABEL:CODEC:SIZE, one averaging round each")
    parser.add_argument("--initial-peers", nargs="*", default=[])
    args = parser.parse_args()

    for spec in args.rounds:  # load every codec (the blockwise ones compile their kernels) before any process forks
        get_compression(spec.split(":")[1])
    dht = start_dht(
        initial_peers=args.initial_peers,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        announce_maddrs=[],
        identity=None,
        timeout=30,
    )
    # One averager per round, all created up front and shut down together at the end: shutting an averager down
    # while its DHT lives on can crash the DHT process (it may still be unpickling a pipe from the dead averager).
    exchanges: list[tuple[str, str, int, GossipExchange]] = []
    try:
        print(f"READY {dht.get_visible_maddrs()[0]}", flush=True)
        for spec in args.rounds:
            label, codec, size = spec.split(":")
            exchange = GossipExchange(
                dht,
                run_id=f"codec-test-{label}",
                size=int(size),
                state_provider=lambda **_: ({}, []),
                target_group_size=args.group_size,
                quorum=args.group_size,
                min_matchmaking_time=2.0,
                request_timeout=1.0,
                allreduce_timeout=30.0,
                next_chunk_timeout=10.0,
                compression=get_compression(codec),
            )
            exchanges.append((label, codec, int(size), exchange))
        # Every round's merge lands in one buffer, as an island's does (GossipExchange.average's `out`).
        landing = torch.full((max(size for _, _, size, _ in exchanges),), float("nan"))
        for label, codec, size, exchange in exchanges:
            print(f"PREPARED {label}", flush=True)
            assert sys.stdin.readline().strip() == "GO"
            vector = round_vector(args.seed, size, label)
            result = exchange.average(vector, {"codec": codec}, weight=1.0, grace_s=2.0, timeout=40.0, out=landing)
            found = strangers({"codec": codec}, result.partners, keys=("codec",))
            mismatch = f"codec mismatch: {describe_strangers({'codec': codec}, found)}" if found else None
            if result.merged is not None:
                torch.save(result.merged.clone(), args.out / f"{label}-{args.seed}.pt")
            record = {
                "label": label,
                "merged": result.merged is not None,
                "in_out": result.merged is not None and result.merged.data_ptr() == landing.data_ptr(),
                "group": len(result.partners) + 1,
                "error": result.error,
                "mismatch": mismatch,
                "bytes_sent": result.bytes_sent,
            }
            print("RESULT " + json.dumps(record), flush=True)
    finally:
        for *_, exchange in exchanges:
            exchange.shutdown()
        shutdown_dht(dht)


if __name__ == "__main__":
    main()
