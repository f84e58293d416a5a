"""Trust pieces without processes: robust aggregation, membership tokens, record checks, state verification."""

from __future__ import annotations

import json
import time

import pytest
import torch

from p2p_diloco.diloco.outer import state_digest
from p2p_diloco.diloco.robust import aggregate, centered_clip, clip_norms
from p2p_diloco.net import membership as tokens
from p2p_diloco.net.record_schema import problem
from p2p_diloco.net.state_transfer import Claim, choose
from p2p_diloco.net.state_transfer import problem as state_problem


def honest_parts(count: int, size: int = 1000, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    center = torch.randn(size, generator=generator)
    return [center + 0.1 * torch.randn(size, generator=generator) for _ in range(count)]


@pytest.mark.parametrize("rule", ["clip", "trimmed", "median"])
def test_one_attacker_moves_a_robust_aggregate_little(rule: str) -> None:
    honest = honest_parts(3)
    truth = torch.stack(honest).mean(dim=0)
    for attack in (honest[0] * 1000, torch.randn(1000) * 100, -10 * honest[0]):
        value, dropped = aggregate(rule, [*honest, attack], [1.0] * 4)
        assert not dropped
        error = float((value - truth).norm() / truth.norm())
        plain = float((sum([*honest, attack]) / 4 - truth).norm() / truth.norm())
        assert error < 0.35 and error < plain / 5, (rule, error, plain)


def test_non_finite_members_are_dropped_and_named() -> None:
    honest = honest_parts(2)
    poisoned = honest[0].clone()
    poisoned[:10] = float("nan")
    for rule in ("none", "clip", "trimmed", "median"):
        value, dropped = aggregate(rule, [honest[0], poisoned, honest[1]], [1.0, 1.0, 1.0])
        assert dropped == [1] and bool(torch.isfinite(value).all())
    with pytest.raises(ValueError):
        aggregate("clip", [poisoned], [1.0])


def test_without_an_attacker_robust_rules_stay_close_to_the_mean() -> None:
    honest = honest_parts(4, seed=3)
    mean = torch.stack(honest).mean(dim=0)
    value, _ = aggregate("clip", honest, [1.0] * 4)
    assert float((value - mean).norm() / mean.norm()) < 0.02
    assert torch.allclose(
        aggregate("none", honest, [1.0, 1.0, 2.0, 0.0])[0], (honest[0] + honest[1] + 2 * honest[2]) / 4
    )


def test_norm_clipping_and_centered_clip_basics() -> None:
    parts = torch.stack([torch.ones(4), torch.ones(4) * 2, torch.ones(4) * 100])
    clipped = clip_norms(parts, multiple=3.0)
    assert float(clipped[2].norm()) == pytest.approx(3 * float(parts[1].norm()))
    assert torch.equal(centered_clip(torch.ones(3, 5), torch.ones(3)), torch.ones(5))


def test_membership_tokens_are_bound_to_a_peer_and_expire(tmp_path) -> None:
    public = tokens.new_owner_key(tmp_path / "owner.key")
    owner = tokens.load_owner_key(tmp_path / "owner.key")
    member = tokens.Membership(tokens.parse_public_key(public), run_id="run")
    token = tokens.issue_token(owner, "QmAlice", 3600)
    assert member.reason_to_refuse(token, "QmAlice") is None
    assert "issued to QmAlice" in member.reason_to_refuse(token, "QmMallory")
    assert "expired" in member.reason_to_refuse(token, "QmAlice", now=time.time() + 7200)
    forged = json.loads(json.dumps(token))
    forged["token"]["peer_id"] = "QmMallory"
    assert "signed by the swarm's owner" in member.reason_to_refuse(forged, "QmMallory")
    stranger = tokens.issue_token(tokens.Ed25519PrivateKey.generate(), "QmAlice", 3600)
    assert "signed by the swarm's owner" in member.reason_to_refuse(stranger, "QmAlice")
    assert "for run 'other'" in member.reason_to_refuse(tokens.issue_token(owner, "QmAlice", 60, "other"), "QmAlice")
    revoked = member.with_revocations(tokens.revocation_list(owner, ["QmAlice"]))
    assert "revoked" in revoked.reason_to_refuse(token, "QmAlice")
    assert member.with_revocations(tokens.revocation_list(tokens.Ed25519PrivateKey.generate(), ["QmAlice"])) is member
    with pytest.raises(tokens.MembershipError, match="ed25519:"):
        tokens.parse_public_key("ssh-rsa AAAA")
    with pytest.raises(tokens.MembershipError, match="never overwritten"):
        tokens.new_owner_key(tmp_path / "owner.key")
    assert tokens.parse_duration("30d") == 30 * 86400 and tokens.parse_duration("90m") == 5400
    with pytest.raises(tokens.MembershipError, match="--expires"):
        tokens.parse_duration("soon")


def test_records_that_break_the_schema_are_named() -> None:
    good = {"peer_id": "Qm", "protocol": 2, "fingerprint": "f", "codec": "fp32", "outer_step": 3, "tokens": 10}
    assert problem(good) is None
    assert "outer_step" in problem({**good, "outer_step": "garbage"})
    assert "outer_step" in problem({**good, "outer_step": None})
    assert "outer_step" in problem({**good, "outer_step": 10**12})
    assert "loss" in problem({**good, "loss": float("nan")})
    assert "maddrs" in problem({**good, "maddrs": ["x"] * 100})
    assert problem({**good, "leaving": True}) is None
    assert "leaving" in problem({**good, "leaving": "soon"})
    assert "not a record" in problem(["a list"])


def test_a_state_is_adopted_only_as_claimed_by_most_donors() -> None:
    anchor, momentum = torch.randn(8), torch.zeros(8)
    honest = Claim(5, state_digest(anchor, momentum), "model")
    liar = Claim(9, "ffff", "model")
    claims = {"a": honest, "b": honest, "c": liar, "d": Claim(5, "eeee", "other-model")}
    chosen, donors = choose(claims, "model", max_step=None)
    assert chosen == honest and sorted(donors) == ["a", "b"]
    assert choose({"a": honest, "c": liar}, "model", max_step=6)[0] == honest  # step 9 is not plausible
    metadata = {"outer_step": 5, "digest": honest.digest, "fingerprint": "model"}
    assert state_problem((metadata, [anchor, momentum]), honest, [(8,), (8,)]) is None
    assert "shapes" in state_problem((metadata, [anchor[:4], momentum]), honest, [(8,), (8,)])
    assert "NaN" in state_problem((metadata, [anchor * float("nan"), momentum]), honest, [(8,), (8,)])
    assert "digest" in state_problem((metadata, [anchor + 1, momentum]), honest, [(8,), (8,)])


def test_one_peers_word_never_refuses_a_join(caplog: pytest.LogCaptureFixture) -> None:
    from p2p_diloco.net.records import ModelMismatchError, ProtocolMismatchError, refuse_strangers

    ours = {"protocol": 2, "version": "1", "fingerprint": "aaaa", "codec": "fp32"}
    lone = {"x": {**ours, "fingerprint": "ffff"}}
    refuse_strangers("run", ours, lone)  # a single stranger: a warning naming it
    assert "island x announces fingerprint 'ffff'" in caplog.text
    disagreeing = {"x": {**ours, "fingerprint": "ffff"}, "y": {**ours, "codec": "int4"}, "z": {**ours, "protocol": 9}}
    refuse_strangers("run", ours, disagreeing)
    assert "island z speaks wire protocol 9" in caplog.text
    refuse_strangers("run", ours, {"x": {**ours, "fingerprint": "ffff"}, "ours": ours, "w": {**ours, "codec": "int4"}})

    with pytest.raises(ModelMismatchError, match=r"trains model ffff \(islands x, y\)"):
        refuse_strangers("run", ours, {"x": {**ours, "fingerprint": "ffff"}, "y": {**ours, "fingerprint": "ffff"}})
    with pytest.raises(ModelMismatchError, match=r"codec mismatch: .* as int4 \(islands x, y\)"):
        refuse_strangers("run", ours, {"x": {**ours, "codec": "int4"}, "y": {**ours, "codec": "int4"}})
    with pytest.raises(ProtocolMismatchError, match=r"islands x, y of run 'run' speak p2p-diloco wire protocol 3"):
        refuse_strangers("run", ours, {"x": {**ours, "protocol": 3}, "y": {**ours, "protocol": 3}})


def test_a_donor_that_trained_on_is_probed_again_not_banned() -> None:
    import asyncio

    from p2p_diloco.net.state_transfer import verified_download

    def state(step: int, value: float) -> tuple[dict, list[torch.Tensor]]:
        tensors = [torch.full((3,), value)]
        return {"outer_step": step, "digest": state_digest(*tensors), "fingerprint": "m"}, tensors

    steps = {"a": 4, "b": 4}
    downloads: list[str] = []
    liars: list[str] = []

    async def ask(peer: str) -> dict:
        return state(steps[peer], float(steps[peer]))[0]

    async def download(peer: str):
        downloads.append(peer)
        steps[peer] += 1  # each donor finishes a round between its probe and its download
        return state(steps[peer], float(steps[peer]))

    async def run():
        return await verified_download(
            ["a", "b"], ask=ask, download=download, fingerprint="m", shapes=[(3,)], max_step=None,
            on_liar=lambda peer, why: liars.append(peer), timeout=5,
        )  # fmt: skip

    assert asyncio.run(run()) is None  # never the state it was not promised
    assert liars == [] and len(downloads) == 6  # three probe rounds of two donors, nobody blamed

    steps.update(a=4, b=4)
    liars.clear()

    async def lying_download(peer: str):
        metadata, tensors = state(steps[peer], float(steps[peer]))
        return metadata, [tensors[0] + 1]  # the promised step, other bytes

    async def run_lie():
        return await verified_download(
            ["a"], ask=ask, download=lying_download, fingerprint="m", shapes=[(3,)], max_step=None,
            on_liar=lambda peer, why: liars.append(peer), timeout=5,
        )  # fmt: skip

    assert asyncio.run(run_lie()) is None and liars == ["a"]


def test_a_joining_island_takes_an_honest_donor_ahead_of_its_records_but_not_a_liar_far_beyond() -> None:
    """Islands re-announce every announce_every rounds, so honest donors run ahead of their records (in the chaos
    benchmark, records at step 7 and donors at 10): the join takes them at once, and still bounds a liar."""
    from types import SimpleNamespace

    from p2p_diloco.config import NetworkConfig
    from p2p_diloco.island.checkpoints import donor_step_limit, swarm_state

    records = {f"island-{i}": {"outer_step": step} for i, step in enumerate([7, 7, 6, 8])}
    link = SimpleNamespace(peer_id="me", records=SimpleNamespace(read=lambda: records))
    network = NetworkConfig(announce_every=4, state_wait_s=0.0)
    bounds: list[int | None] = []

    def download(max_step: int | None):
        bounds.append(max_step)
        donor_step = 10  # an honest donor three rounds past the records
        return ({"outer_step": donor_step}, []) if max_step is None or donor_step <= max_step else None

    state = swarm_state(link, network, SimpleNamespace(download=download))
    assert state is not None and state[0]["outer_step"] == 10 and bounds == [12]
    assert donor_step_limit([7, 7, 6, 8], 4) == 12 < 13  # a liar claiming 13 or more is still turned away
    assert donor_step_limit([], 4) is None
    assert donor_step_limit([3, 3], 1) == 5


def test_old_records_age_so_a_dead_incarnation_does_not_hold_the_donor_bound_down() -> None:
    """A restarted island (a new peer id) sees its dead incarnation's record at step 0 beside its donor's at step 3,
    both written a while ago: the donor, 3 steps past its record after rounds of 15 s, is taken; a liar far past
    anything the records allow is not."""
    import time
    from types import SimpleNamespace

    from p2p_diloco.config import NetworkConfig
    from p2p_diloco.island.checkpoints import aged_steps, donor_step_limit, swarm_state

    now = time.time()
    donor = {
        "outer_step": 3,
        "time": now - 20,
        "history": [[1, None, 0, 0, 0, 0, now - 50], [2, None, 0, 0, 0, 0, now - 35]],
    }
    dead = {"outer_step": 0, "time": now - 60, "history": []}
    assert donor_step_limit([0, 3], 4) == 5  # unaged, the dead record sets the clock: the donor at 6 is refused
    aged = aged_steps([donor, dead], now)
    assert aged[0] == 3 + 20 // (15 / 4)  # plausible_limit: rounds up to 4x faster than the record's pace
    assert aged[1] > aged[0]
    records = {"island-0": donor, "island-1-before": dead}
    link = SimpleNamespace(peer_id="me", records=SimpleNamespace(read=lambda: records))
    network = NetworkConfig(announce_every=4, state_wait_s=0.0)

    def offering(donor_step: int):
        def download(max_step: int | None):
            return ({"outer_step": donor_step}, []) if max_step is None or donor_step <= max_step else None

        return SimpleNamespace(download=download)

    state = swarm_state(link, network, offering(6))
    assert state is not None and state[0]["outer_step"] == 6
    assert swarm_state(link, network, offering(100)) is None


def test_records_with_a_malformed_time_or_history_are_not_aged_past_a_step_a_second() -> None:
    import time

    from p2p_diloco.island.checkpoints import aged_steps

    now = time.time()
    records = [
        {"outer_step": 5, "time": "yesterday"},
        {"outer_step": 5, "time": float("nan")},
        {"outer_step": 5, "time": True},
        {"outer_step": 5, "time": now - 10, "history": "garbage"},
        {"outer_step": 5, "time": now - 10, "history": [[1], ["x"]]},
        {"outer_step": 5, "time": now + 1000, "history": None},  # written in the future: no rounds since
    ]
    assert aged_steps(records, now) == [5, 5, 5, 15, 15, 5]
