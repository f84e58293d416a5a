"""One member of a test averaging group, run as its own process so that a test can SIGKILL it mid-round.

Protocol on stdout: "READY <maddr>", then after a line "GO" on stdin, "ALLREDUCE" once the all-reduce has
started, then "RESULT <json>" with the merged vector's checksum (or null when the round was discarded).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

import torch

from p2p_diloco.cli.logs import setup_logging
from p2p_diloco.diloco.staleness import StalenessRule
from p2p_diloco.net.dht import shutdown_dht, start_dht
from p2p_diloco.net.exchange import GossipExchange

STALENESS_RULE = StalenessRule(max_staleness=3, discount=0.5)


def member_vector(seed: int, size: int) -> torch.Tensor:
    """The pseudo-gradient member `seed` contributes (tests recompute it to know the true mean)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, generator=generator)


def cut_reply_streams(after: int) -> None:
    """Fault injection: as a reducer, stop replying to one sender after `after` parts while still reducing every
    part it sends, as when a reply stream breaks in transit. Patched before the averager's process forks. The sender
    is chosen by peer id, not by its place in the group: a group attempt that falls through (a loaded machine) is
    retried with the group shuffled, and the retry must cut the same sender (CI once saw two senders cut)."""
    from p2p_diloco.net.allreduce import StrictAllReduceRunner

    original = StrictAllReduceRunner._accumulate_parts_streaming

    def victim_index(runner: StrictAllReduceRunner) -> int:
        return runner.sender_peer_ids.index(min(peer for peer in runner.sender_peer_ids if peer != runner.peer_id))

    async def cut(self, stream, sender_index: int):
        victim = victim_index(self)
        replies = 0
        async for message in original(self, stream, sender_index):
            if sender_index != victim or replies < after:
                yield message
            replies += 1

    StrictAllReduceRunner._accumulate_parts_streaming = cut
    original_lane = StrictAllReduceRunner.reduce_from_lane

    async def cut_lane(self, lane, sender_index: int) -> None:
        if sender_index == victim_index(self):
            send, replies = lane.send, [0]

            async def lossy_send(part_index, kind, payload, weight=0.0):
                replies[0] += 1
                if replies[0] <= after:
                    return await send(part_index, kind, payload, weight)
                if replies[0] == after + 1:  # the lane breaks on the way back; this reducer still reads every part
                    lane.sock.shutdown(socket.SHUT_WR)
                return len(payload)

            lane.send = lossy_send
        await original_lane(self, lane, sender_index)

    StrictAllReduceRunner.reduce_from_lane = cut_lane


def freeze_after_ticket() -> None:
    """Fault injection: as a sender, take every reducer's lane ticket and then never connect, as an island frozen
    (SIGSTOP) or killed between its ticket and its connect. Patched before the averager's process forks."""
    import asyncio

    from p2p_diloco.net.direct import DirectLanes

    async def frozen(self, peer: str, offer) -> None:
        print("TICKET", flush=True)
        await asyncio.Event().wait()

    DirectLanes.connect = frozen


def freeze_after_frames(count: int) -> None:
    """Fault injection: the averager process stops itself (SIGSTOP) as it is about to send its frame `count` + 1
    over a direct lane, its lanes open: a frozen island's averager mid-round. Patched before the process forks."""
    import os
    import signal

    from p2p_diloco.net.direct import Lane

    send, sent = Lane.send, [0]

    async def freezing(self, *args, **kwargs):
        sent[0] += 1
        if sent[0] == count + 1:
            print("FROZEN", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return await send(self, *args, **kwargs)

    Lane.send = freezing


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--group-size", type=int, required=True)
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--nan", action="store_true", help="contribute a NaN vector")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to find the group")
    parser.add_argument("--chunk-timeout", type=float, default=3.0, help="next_chunk_timeout")
    parser.add_argument("--outer-step", type=int, default=None, help="gather an island's staleness metadata")
    parser.add_argument("--schema-tag", type=int, default=None, help="exchange this fragment only")
    parser.add_argument("--cut-replies-after", type=int, help="fault: cut one sender's reply stream after N parts")
    parser.add_argument("--freeze-after-ticket", action="store_true", help="fault: take lane tickets, never connect")
    parser.add_argument("--freeze-after-frames", type=int, help="fault: the averager stops itself mid-round")
    parser.add_argument("--no-retries", action="store_true", help="report a failed round at once, not retry it")
    parser.add_argument("--lanes", choices=["on", "off"], default="on", help="direct lanes, or libp2p streams only")
    parser.add_argument("--uplink-mbit", type=float, default=0.0, help="pace the lanes to share this uplink")
    args = parser.parse_args()
    setup_logging("info")
    if args.cut_replies_after is not None:
        cut_reply_streams(args.cut_replies_after)
    if args.freeze_after_ticket:
        freeze_after_ticket()
    if args.freeze_after_frames is not None:
        freeze_after_frames(args.freeze_after_frames)

    dht = start_dht(
        initial_peers=args.initial_peers,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        announce_maddrs=[],
        identity=None,
        timeout=30,
    )
    exchange = GossipExchange(
        dht,
        run_id="exchange-test",
        size=args.size,
        state_provider=lambda **_: ({}, []),
        target_group_size=args.group_size,
        quorum=args.group_size,
        min_matchmaking_time=2.0,
        request_timeout=1.0,
        allreduce_timeout=30.0,
        next_chunk_timeout=args.chunk_timeout,
        staleness_rule=STALENESS_RULE,
        direct_lanes=args.lanes == "on",
        uplink_mbit=args.uplink_mbit,
    )
    try:
        if args.schema_tag is not None:
            exchange.averager.set_schema_tag(args.schema_tag)
        print(f"READY {dht.get_visible_maddrs()[0]}", flush=True)
        assert sys.stdin.readline().strip() == "GO"
        vector = member_vector(args.seed, args.size)
        if args.nan:
            vector[::7] = float("nan")
        with exchange.averager.get_tensors() as tensors:
            tensors[0].copy_(vector)
        gather = None
        if args.outer_step is not None:  # as an island whose DHT view of the swarm is no newer than itself
            gather = {"outer_step": args.outer_step, "swarm_step": args.outer_step, "base_weight": 1.0}
        control = exchange.averager.step(
            gather=gather, weight=1.0, timeout=args.timeout, wait=False, allow_retries=not args.no_retries
        )
        while not control.done():
            if control.stage.name == "RUNNING_ALLREDUCE":
                print("ALLREDUCE", flush=True)
                break
            time.sleep(0.001)
        try:
            gathered = control.result(timeout=90)
        except Exception as error:
            gathered = None
            print(f"# step failed: {error!r}", flush=True)
        with exchange.averager.get_tensors() as tensors:
            buffer = tensors[0].clone()
        result = None
        if gathered:
            result = {"sum": float(buffer.double().sum()), "first": buffer[:4].tolist(), "group": len(gathered)}
        restored = bool(torch.equal(buffer, vector)) if not args.nan else None
        counters = exchange.averager.byte_counters
        record = {"merged": result, "restored": restored, "repairs": counters.repairs(), "lanes": counters.lanes()}
        print("RESULT " + json.dumps(record), flush=True)
    finally:
        exchange.shutdown()
        shutdown_dht(dht)


if __name__ == "__main__":
    main()
