"""Join requests that left a follower behind: hivemind's own matchmaking code, two islands' worth in one event loop.

Each island is a real `hivemind.averaging.matchmaking.Matchmaking` in the state of a search (its group declared at
an expiration, looking for a group); an ask is what `Matchmaking._request_join_group` does up to the leader's first
answer: hold its own join lock while it waits for that answer, at most `request_timeout`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace

from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time

from p2p_diloco.net.join_races import asks_out_of_order, join_responses

REQUEST_TIMEOUT = 1.0
STAGGER_S = 0.25
"""Island 0 waits this much longer for its answer than island 1: the two timeouts never fire together, which left
the order of events to the event loop."""
PEERS = [
    PeerID.from_base58("QmYzW8DbLz79TE2Cch6C8mQ8fu9ZaB665MUggXHY2xxat2"),
    PeerID.from_base58("QmYZ5J2sVP2rZXAxEKd2EQSwbVr3278Hcr72Vrk2N1bWrG"),
]


def _island(peer: PeerID, expiration: float) -> Matchmaking:
    """A Matchmaking searching for a group of 2, declared as a leader until `expiration`."""
    p2p = SimpleNamespace(peer_id=peer)
    matchmaking = Matchmaking(
        p2p,
        b"schema",
        SimpleNamespace(peer_id=peer),
        servicer_type=DecentralizedAverager,
        prefix="run",
        target_group_size=2,
        min_group_size=2,
        min_matchmaking_time=5.0,
        request_timeout=REQUEST_TIMEOUT,
        client_mode=False,
    )
    matchmaking.potential_leaders.declared_group_key = matchmaking.group_key_manager.current_key
    matchmaking.potential_leaders.declared_expiration_time = expiration
    matchmaking.step_control = SimpleNamespace(data_for_gather=b"gathered")
    return matchmaking


def _request(asker: Matchmaking) -> averaging_pb2.JoinRequest:
    return averaging_pb2.JoinRequest(
        schema_hash=b"schema",
        expiration=asker.potential_leaders.declared_expiration_time,
        gather=b"gathered",
        group_key=asker.group_key_manager.current_key,
    )


def _answers(leader: Matchmaking, asker: Matchmaking, guarded: bool):
    """What `leader` answers `asker`'s join request: hivemind's handler, with or without the guard."""
    context = SimpleNamespace(remote_id=asker.peer_id)
    responses = leader.rpc_join_group(_request(asker), context)
    return join_responses(leader, _request(asker), asker.peer_id, responses) if guarded else responses


async def _serve(answers, stream: asyncio.Queue) -> None:
    """The leader's side of the join stream: its handler runs on whether or not the asker still listens."""
    async for answer in answers:
        stream.put_nowait(answer)


async def _ask(
    asker: Matchmaking, leader: Matchmaking, guarded: bool, patience: float = REQUEST_TIMEOUT
) -> averaging_pb2.MessageFromLeader | None:
    """The first answer `asker` gets from `leader` within `patience` (None: it gave up), as hivemind asks."""
    stream: asyncio.Queue = asyncio.Queue()
    async with asker.lock_request_join_group:
        asker.serving = asyncio.ensure_future(_serve(_answers(leader, asker, guarded), stream))
        try:
            return await asyncio.wait_for(stream.get(), patience)
        except asyncio.TimeoutError:
            return None


async def _ask_each_other(guarded: bool) -> tuple[dict, list[Matchmaking]]:
    now = get_dht_time()
    islands = [_island(PEERS[0], now + 3.0), _island(PEERS[1], now + 4.0)]  # island 0 comes first: it leads
    async with contextlib.AsyncExitStack() as searching:
        for island in islands:
            await searching.enter_async_context(island.lock_looking_for_group)
        started = time.monotonic()
        answers = await asyncio.gather(
            _ask(islands[0], islands[1], guarded, patience=REQUEST_TIMEOUT + STAGGER_S),
            _ask(islands[1], islands[0], guarded),
        )
        seconds = time.monotonic() - started
        await asyncio.wait_for(asyncio.gather(*(island.serving for island in islands)), 5.0)
        return {"answers": answers, "seconds": seconds}, islands


def test_two_islands_asking_each_other_in_hivemind_both_give_up_and_one_leads_the_other_that_left() -> None:
    result, islands = asyncio.run(_ask_each_other(guarded=False))
    to_follower, to_leader = result["answers"]  # island 0 asked island 1, island 1 asked island 0
    assert to_leader is None, "island 1's ask waits for island 0's lock until request_timeout"
    assert result["seconds"] >= REQUEST_TIMEOUT
    # Its lock back, island 1 refuses island 0 (which expires first); island 0's lock comes back in turn, and it
    # accepts the ask island 1 gave up on: a group with an island that left.
    assert to_follower.code == averaging_pb2.BAD_EXPIRATION_TIME
    assert set(islands[0].assembled_group.result().peer_ids) == set(PEERS)


def test_two_islands_asking_each_other_settle_it_at_once_by_the_leader_order() -> None:
    result, islands = asyncio.run(_ask_each_other(guarded=True))
    to_follower, to_leader = result["answers"]  # island 0 asked island 1, island 1 asked island 0
    assert to_follower.code == averaging_pb2.BAD_EXPIRATION_TIME, "island 1 refuses to lead island 0: island 0 leads"
    assert to_leader.code == averaging_pb2.ACCEPTED
    assert result["seconds"] < REQUEST_TIMEOUT, "settled without waiting out a timeout"
    assert set(islands[0].assembled_group.result().peer_ids) == set(PEERS), "island 0 leads, island 1 heard in time"
    assert not islands[1].assembled_group.done()  # until island 1's hivemind takes the go it now hears in time


def test_a_request_that_waited_out_its_askers_timeout_is_refused_not_taken_into_a_group() -> None:
    async def scenario(guarded: bool) -> tuple[averaging_pb2.MessageFromLeader, Matchmaking]:
        now = get_dht_time()
        leader, asker = _island(PEERS[0], now + 3.0), _island(PEERS[1], now + 4.0)
        async with leader.lock_looking_for_group:
            answers = _answers(leader, asker, guarded)
            async with leader.lock_request_join_group:  # the leader asks a third island meanwhile
                waiting = asyncio.ensure_future(anext(answers))
                await asyncio.sleep(REQUEST_TIMEOUT)  # the asker gave up by now
            first = await waiting
            if first.code == averaging_pb2.ACCEPTED:
                await anext(answers)  # hivemind assembles the group after its first answer, and sends the go
            await answers.aclose()
            return first, leader

    first, leader = asyncio.run(scenario(guarded=False))
    assert first.code == averaging_pb2.ACCEPTED and PEERS[1] in leader.assembled_group.result().peer_ids

    first, leader = asyncio.run(scenario(guarded=True))
    assert first.code == averaging_pb2.NOT_LOOKING_FOR_GROUP
    assert not leader.assembled_group.done() and not leader.current_followers


def test_a_request_answered_in_time_joins_as_before() -> None:
    async def scenario() -> tuple[list, Matchmaking]:
        now = get_dht_time()
        leader, asker = _island(PEERS[0], now + 3.0), _island(PEERS[1], now + 4.0)
        async with leader.lock_looking_for_group:
            answers = [answer.code async for answer in _answers(leader, asker, guarded=True)]
        return answers, leader

    answers, leader = asyncio.run(scenario())
    assert answers == [averaging_pb2.ACCEPTED, averaging_pb2.BEGIN_ALLREDUCE]
    assert set(leader.assembled_group.result().peer_ids) == set(PEERS)


def test_only_a_request_hivemind_refuses_by_expiration_is_refused_before_the_lock() -> None:
    async def scenario() -> list[bool]:
        leader = _island(PEERS[0], 100.0)
        asks = [SimpleNamespace(expiration=when) for when in (99.0, 100.0, 101.0)]
        out_of_order = [asks_out_of_order(ask, leader) for ask in asks]
        for ask, refused in zip(asks, out_of_order):
            request = _request(leader)  # well formed, with the asker's expiration
            request.expiration = ask.expiration
            async with leader.lock_looking_for_group:
                reason = leader._check_reasons_to_reject(request, SimpleNamespace(remote_id=PEERS[1]))
            assert (reason is not None and reason.code == averaging_pb2.BAD_EXPIRATION_TIME) == refused, reason
        leader.potential_leaders.declared_expiration_time = float("inf")  # not declared yet: hivemind decides
        return out_of_order + [asks_out_of_order(asks[0], leader)]

    assert asyncio.run(scenario()) == [True, False, False, False]
