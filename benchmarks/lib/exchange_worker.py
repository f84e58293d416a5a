"""One peer process of the exchange benchmark (`exchange.py --worker SYSTEM`): it sets up its system, prints
READY, then averages its vector once per GO line on stdin and prints one ROUND <json> line per round."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from p2p_diloco.process import die_with_parent

SYSTEMS = ("gloo", "hivemind", "p2p_diloco")
BYTES_PER_VALUE = 4
TOLERANCE = 1e-5

# Matchmaking settings shared by both hivemind-based systems: the group starts as soon as it is full.
MIN_MATCHMAKING_TIME = 1.0
REQUEST_TIMEOUT = 0.5
NEXT_CHUNK_TIMEOUT = 30.0
STEP_TIMEOUT = 60.0  # seconds to find the group
POLL_S = 0.005

Round = Callable[[Any], tuple[dict, Any]]
"""One round of a system: this peer's vector in, (the round's record, the averaged result or None) out."""


def allreduce_timeout(values: int) -> float:
    """A bound on one all-reduce that a healthy round never approaches (~0.15 s per million values seen)."""
    return max(60.0, 3.0 * values / 1e6)


def make_vectors(rank: int, peers: int, values: int) -> tuple[Any, Any]:
    """This peer's contribution and the true mean over all peers, without materialising the other peers' vectors.

    Peer r contributes base + (r + 1) * ramp, so the mean is base + (peers + 1) / 2 * ramp.
    """
    import torch

    base = torch.randn(values, generator=torch.Generator().manual_seed(1234))
    ramp = torch.linspace(-1.0, 1.0, values)
    vector = ramp.mul(rank + 1.0).add_(base)
    expected = ramp.mul_((peers + 1) / 2).add_(base)
    return vector, expected


def max_error(result: Any, expected: Any) -> float | None:
    """Largest absolute deviation from the true mean (None when there is no result or it is not finite)."""
    if result is None:
        return None
    error = float((result - expected).abs().max())
    return error if math.isfinite(error) else None


def _hivemind_round(averager: Any, vector: Any, out: Any) -> tuple[dict, Any]:
    from hivemind.averaging.control import AveragingStage

    t0 = time.perf_counter()
    with averager.get_tensors() as tensors:
        tensors[0].copy_(vector)
    t_in = time.perf_counter()
    control = averager.step(weight=1.0, timeout=STEP_TIMEOUT, wait=False)
    while not control.done() and control.stage != AveragingStage.RUNNING_ALLREDUCE:
        time.sleep(POLL_S)
    t_allreduce = time.perf_counter()
    error = None
    try:
        gathered = control.result(timeout=averager._allreduce_timeout + 30)
        group = len(gathered) if gathered else 0
    except Exception as exc:  # a failed round is recorded, not fatal
        error, group = f"{type(exc).__name__}: {exc}", 0
    t_done = time.perf_counter()
    with averager.get_tensors() as tensors:
        result = out.copy_(tensors[0])  # into a buffer kept across rounds, as our exchange's `out`
    t_out = time.perf_counter()
    return {
        "seconds": t_done - t_in,
        "matchmaking_s": t_allreduce - t_in,
        "allreduce_s": t_done - t_allreduce,
        "copy_in_s": t_in - t0,
        "copy_out_s": t_out - t_done,
        "seconds_with_copies": t_out - t0,
        "group": group,
        "error": error,
    }, (result if error is None else None)


def _p2p_round(exchange: Any, vector: Any, out: Any) -> tuple[dict, Any]:
    t0 = time.perf_counter()
    result = exchange.average(vector, {}, weight=1.0, grace_s=0.0, timeout=STEP_TIMEOUT, out=out)
    t1 = time.perf_counter()
    return {
        # The whole API call: copy-in, matchmaking, all-reduce (with backup and checks), copy of the result out.
        "seconds": t1 - t0,
        "matchmaking_s": result.matchmaking_s,  # includes the copy into the averager's buffer
        "allreduce_s": (t1 - t0) - result.matchmaking_s,  # includes the copy of the result out
        "seconds_with_copies": t1 - t0,
        "group": 1 + len(result.partners) if result.merged is not None else 0,
        "bytes_sent": result.bytes_sent,
        "bytes_recv": result.bytes_recv,
        "streams_repaired": result.streams_repaired,
        "error": result.error,
    }, result.merged


def _gloo_round(dist: Any, buffer: Any, vector: Any, peers: int) -> tuple[dict, Any]:
    t0 = time.perf_counter()
    buffer.copy_(vector)
    t_in = time.perf_counter()
    dist.barrier()
    t_start = time.perf_counter()
    dist.all_reduce(buffer)
    buffer.div_(peers)
    t_done = time.perf_counter()
    return {
        "seconds": t_done - t_start,
        "matchmaking_s": 0.0,
        "allreduce_s": t_done - t_start,
        "copy_in_s": t_in - t0,
        "barrier_s": t_start - t_in,
        "seconds_with_copies": (t_done - t_start) + (t_in - t0),
        "group": peers,
        "error": None,
    }, buffer


def _start_gloo(args: argparse.Namespace, cleanup: list[Callable[[], Any]]) -> Round:
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}:{args.port}",
        rank=args.rank,
        world_size=args.peers,
        timeout=datetime.timedelta(seconds=allreduce_timeout(args.values) + 60),
    )
    cleanup.append(dist.destroy_process_group)
    buffer = torch.zeros(args.values)
    return lambda vector: _gloo_round(dist, buffer, vector, args.peers)


def _start_dht(args: argparse.Namespace, ready: dict, cleanup: list[Callable[[], Any]]) -> Any:
    from hivemind.p2p import P2P

    from p2p_diloco.net.dht import shutdown_dht, start_dht

    if args.socket_dir:
        # hivemind puts its daemon's unix sockets in /tmp, where the test suite's no_leftover_daemons
        # fixture unlinks every new hivemind-*.sock, live or not; a test session running meanwhile on
        # the same machine would cut this peer off from its p2pd. Keep them in a folder of our own.
        P2P._UNIX_SOCKET_PREFIX = f"/unix{args.socket_dir}/hivemind-"

    initial_peers = args.initial_peers
    if args.rank > 0 and not initial_peers:  # imports done: now wait for the first peer's address
        line = sys.stdin.readline().split()
        assert line and line[0] == "PEERS", f"expected PEERS, got {line}"
        initial_peers = line[1:]
    dht = start_dht(
        initial_peers=initial_peers,
        host_maddrs=[f"/ip4/{args.host}/tcp/0"],
        announce_maddrs=[],
        identity=None,
        timeout=60,
    )
    cleanup.append(lambda: shutdown_dht(dht))
    ready.update(maddr=str(dht.get_visible_maddrs()[0]), dht_pid=dht.pid)
    return dht


def _start_averager(args: argparse.Namespace, ready: dict, cleanup: list[Callable[[], Any]]) -> Round:
    """hivemind's DecentralizedAverager used directly, or p2p-diloco's GossipExchange on top of it."""
    import torch
    from hivemind.averaging import DecentralizedAverager

    from p2p_diloco.net.codecs import get_compression

    compression = get_compression(args.codec)  # before the averager forks (the codec loads its kernels here)
    if args.worker == "hivemind" and args.codec == "int8":
        from lib.stock_int8 import install_stock_int8

        compression = install_stock_int8()  # hivemind's own int8 (bitsandbytes, blocks of 4096), not ours
    dht = _start_dht(args, ready, cleanup)
    out = torch.empty(args.values)  # each round's average lands here: a caller's buffer kept across rounds
    timeouts = dict(
        min_matchmaking_time=MIN_MATCHMAKING_TIME,
        request_timeout=REQUEST_TIMEOUT,
        allreduce_timeout=allreduce_timeout(args.values),
        next_chunk_timeout=NEXT_CHUNK_TIMEOUT,
    )
    if args.worker == "hivemind":

        class Averager(DecentralizedAverager):
            """hivemind's averager, unchanged except that it dies with this process."""

            def run(self) -> None:
                die_with_parent()
                super().run()

        averager = Averager(
            [torch.zeros(args.values)],
            dht=dht,
            prefix="exchange_bench",
            start=True,
            target_group_size=args.peers,
            min_group_size=args.peers,
            compression=compression,
            **({"part_size_bytes": args.part_size} if args.part_size else {}),
            declare_state_period=10.0,
            shutdown_timeout=3.0,
            **timeouts,
        )
        run_round = lambda vector: _hivemind_round(averager, vector, out)  # noqa: E731
    else:
        from p2p_diloco.net.exchange import GossipExchange

        exchange = GossipExchange(
            dht,
            run_id="exchange_bench",
            size=args.values,
            state_provider=lambda **_: ({}, []),
            target_group_size=args.peers,
            quorum=args.peers,
            compression=compression,
            codec=args.codec,
            part_size_bytes=args.part_size,
            uplink_mbit=args.uplink_mbit,
            **timeouts,
        )
        averager = exchange.averager
        run_round = lambda vector: _p2p_round(exchange, vector, out)  # noqa: E731
    # Nothing of the averager's state matters at exit: kill it rather than wait for its shutdown timeout.
    cleanup.insert(0, lambda: (averager.kill(), averager.join(5)))
    ready["averager_pid"] = averager.pid
    ready["compression"] = compression
    return run_round


def tolerance(codec: str, vector: Any, expected: Any, compression: Any = None) -> float:
    """How far a correct result may be from the true mean: exact for fp32, else two quantisation passes.

    A codec's round has every contribution quantised once and the reduced parts once more; three times the worst
    one-pass error still catches a missing contribution (it shifts the mean by a whole ramp / peers).
    """
    if codec == "fp32":
        return TOLERANCE
    from p2p_diloco.net.codecs import round_trip

    worst = max(float((round_trip(compression or codec, x) - x).abs().max()) for x in (vector, expected))
    return 3.0 * worst + TOLERANCE


def _serve(run_round: Round, vector: Any, expected: Any, no_check: bool, allowed: float = TOLERANCE) -> None:
    """One round per GO line on stdin, until EXIT or the end of input; one ROUND line per round."""
    for line in sys.stdin:
        command = line.strip()
        if command == "EXIT":
            break
        if command != "GO":
            continue
        record, result = run_round(vector)
        if no_check:  # profiled runs: keep the check's own CPU out of the samples
            record["max_abs_error"], record["ok"] = None, record["error"] is None and result is not None
        else:
            cpu0 = time.process_time()
            record["max_abs_error"] = max_error(result, expected)
            record["check_cpu_s"] = time.process_time() - cpu0  # not part of any system's cost
            error = record["max_abs_error"]
            record["ok"] = record["error"] is None and error is not None and error <= allowed
        del result
        print("ROUND " + json.dumps(record), flush=True)


def worker(args: argparse.Namespace) -> int:
    """One peer: set up the system, print READY, then run one round per GO line until EXIT or end of input."""
    die_with_parent()  # never outlive the benchmark (its children die with this process in turn)
    ready: dict[str, Any] = {"pid": os.getpid()}
    cleanup: list[Callable[[], Any]] = []
    try:
        run_round = _start_gloo(args, cleanup) if args.worker == "gloo" else _start_averager(args, ready, cleanup)
        vector, expected = make_vectors(args.rank, args.peers, args.values)
        allowed = tolerance(args.codec, vector, expected, ready.pop("compression", None))
        print("READY " + json.dumps({**ready, "tolerance": allowed}), flush=True)
        _serve(run_round, vector, expected, args.no_check, allowed)
    finally:
        for step in cleanup:
            try:
                step()
            except Exception as exc:  # best effort: the parent kills whatever is left
                print(f"# cleanup: {exc!r}", file=sys.stderr, flush=True)
    return 0
