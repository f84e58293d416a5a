"""Integration: real bootstrap and peer processes with hivemind daemons on 127.0.0.1."""

from __future__ import annotations

import signal
from collections import defaultdict

import psutil
import torch
from conftest import TINY, LocalSwarm, wait_until

from p2p_diloco.config import load_config
from p2p_diloco.diloco.fragments import fragment_layout
from p2p_diloco.diloco.inner import make_inner_optimizer
from p2p_diloco.diloco.outer import (
    OuterOptimizer,
    assign_parameters_,
    flatten_parameters,
    pseudo_gradient,
)
from p2p_diloco.train.checkpoint import latest_checkpoint, load_checkpoint
from p2p_diloco.train.data import BatchStream, data_seed, load_shards
from p2p_diloco.train.model import build_model


def _by_step(peers) -> dict[int, dict[str, dict]]:
    steps: dict[int, dict[str, dict]] = defaultdict(dict)
    for peer in peers:
        for record in peer.records():
            steps[record["outer_step"]][peer.name] = record
    return steps


def test_three_islands_train_one_model(local_swarm: LocalSwarm) -> None:
    local_swarm.bootstrap()
    args = ["--num-shards", "3", "--outer-steps", "6", "--target-group-size", "3"]
    peers = [local_swarm.peer(f"island-{i}", "--shard-index", str(i), *args) for i in range(3)]
    for peer in peers:
        assert peer.wait(240) == 0, peer.log_text()[-3000:]

    for peer in peers:
        records = peer.records()
        steps = [r["outer_step"] for r in records]
        # An island that misses a round (a slow start) catches up by adopting the group's state: it may skip one.
        assert steps == sorted(set(steps)) and steps[-1] == 6 and len(steps) >= 5, steps
        merged_rounds = sum(r["partners"] > 0 for r in records)
        assert merged_rounds >= 4, f"{peer.name} merged in only {merged_rounds} of {len(records)} rounds"
        assert records[-1]["eval_loss"] < records[0]["eval_loss"] - 0.3
        assert all(r["bytes_sent"] > 0 for r in records if r["partners"] > 0)

    full_rounds = 0
    for step, records in _by_step(peers).items():
        if len(records) == 3 and all(r["partners"] == 2 for r in records.values()):
            full_rounds += 1
            digests = {r["anchor_digest"] for r in records.values()}
            assert len(digests) == 1, f"islands disagree right after the all-island round {step}: {digests}"
    assert full_rounds >= 3

    anchors = [load_checkpoint(latest_checkpoint(peer.checkpoint_dir))["anchor"] for peer in peers]
    last = _by_step(peers)[6]
    if all(r["partners"] == 2 for r in last.values()):
        for anchor in anchors[1:]:
            torch.testing.assert_close(anchor, anchors[0], atol=1e-6, rtol=0)


def reference_diloco(config, num_islands: int) -> torch.Tensor:
    """Single-process (Streaming) DiLoCo: every island in every round, equal shards, mean of pseudo-gradients.

    With train.fragments = P, round r syncs fragment r mod P after H/P inner steps; with train.overlap_steps = τ
    its mean lands τ inner steps into the next round and is mixed into the local weights with train.mix_alpha.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    train = config.train
    try:
        shards = load_shards(config.data)
        anchor_model = build_model(config.model, seed=train.seed)
        outer = OuterOptimizer(
            flatten_parameters(anchor_model.parameters()), lr=train.outer_lr, momentum=train.outer_momentum
        )
        fragments = fragment_layout(anchor_model, train.fragments) if train.fragments > 1 else None
        islands = []
        for index in range(num_islands):
            model = build_model(config.model, seed=train.seed)
            optimizer, scheduler = make_inner_optimizer(model, train.lr, train.weight_decay, train.warmup_steps)
            stream = BatchStream(
                shards.train_shard(index, num_islands),
                train.batch_size,
                config.model.seq_len,
                seed=data_seed(train.seed, index, ""),
            )
            islands.append((model, optimizer, scheduler, stream))

        def inner(steps: int) -> None:
            for model, optimizer, scheduler, stream in islands:
                for _ in range(steps):
                    inputs, targets = stream.next_batch()
                    _, loss = model(inputs, targets)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
                    optimizer.step()
                    scheduler.step()

        def land(fragment: int | None, update: torch.Tensor) -> None:
            if fragment is None:
                anchor = outer.step(update)
            else:
                outer.step_fragment(update, fragments[fragment].index)
                anchor = outer.anchor.data
            for model, *_ in islands:
                if fragment is None and train.overlap_steps == 0:
                    assign_parameters_(model.parameters(), anchor)
                    continue
                local = flatten_parameters(model.parameters())
                index = slice(None) if fragment is None else fragments[fragment].index
                if train.overlap_steps > 0:
                    local[index] = local[index].mul_(train.mix_alpha).add_(anchor[index], alpha=1.0 - train.mix_alpha)
                else:
                    local[index] = anchor[index]
                assign_parameters_(model.parameters(), local)

        steps = train.inner_steps // train.fragments
        pending = None
        for round_index in range(train.outer_steps):
            early = min(train.overlap_steps, steps) if pending is not None else 0
            inner(early)
            if pending is not None:
                land(*pending)
                pending = None
            inner(steps - early)
            fragment = None if fragments is None else round_index % train.fragments
            deltas = []
            for model, *_ in islands:
                delta = pseudo_gradient(outer.anchor.data, flatten_parameters(model.parameters()))
                deltas.append(delta if fragment is None else delta[fragments[fragment].index])
            pending = (fragment, torch.stack(deltas).mean(dim=0))
            if train.overlap_steps == 0:
                land(*pending)
                pending = None
        if pending is not None:
            land(*pending)
        return outer.anchor.data.clone()
    finally:
        torch.set_num_threads(threads)


def test_swarm_equals_reference_diloco(local_swarm: LocalSwarm) -> None:
    local_swarm.bootstrap()
    overrides = {"train.outer_steps": 3, "train.inner_steps": 5, "data.num_shards": 3}
    args = ["--num-shards", "3", "--outer-steps", "3", "--inner-steps", "5"]
    args += ["--quorum", "3", "--target-group-size", "3", "--averaging-timeout", "90", "--robust-merge", "none"]
    peers = [local_swarm.peer(f"island-{i}", "--shard-index", str(i), *args) for i in range(3)]
    for peer in peers:
        assert peer.wait(240) == 0, peer.log_text()[-3000:]
        assert all(r["partners"] == 2 for r in peer.records()), peer.records()

    expected = reference_diloco(load_config(TINY, overrides), num_islands=3)
    for peer in peers:
        anchor = load_checkpoint(latest_checkpoint(peer.checkpoint_dir))["anchor"]
        difference = (anchor - expected).abs().max().item()
        assert difference < 1e-4, f"{peer.name} differs from reference DiLoCo by {difference}"


def test_streaming_swarm_equals_reference_streaming_diloco(local_swarm: LocalSwarm) -> None:
    local_swarm.bootstrap()
    overrides = {
        "train.outer_steps": 4,
        "train.inner_steps": 10,
        "train.fragments": 2,
        "train.overlap_steps": 2,
        "data.num_shards": 3,
    }
    args = ["--num-shards", "3", "--outer-steps", "4", "--inner-steps", "10", "--fragments", "2"]
    args += [
        "--overlap-steps",
        "2",
        "--quorum",
        "3",
        "--target-group-size",
        "3",
        "--averaging-timeout",
        "90",
        "--robust-merge",
        "none",
    ]
    peers = [local_swarm.peer(f"island-{i}", "--shard-index", str(i), *args) for i in range(3)]
    for peer in peers:
        assert peer.wait(240) == 0, peer.log_text()[-3000:]
        landed = [r for r in peer.records() if r["fragment"] is not None]
        assert [r["fragment"] for r in landed] == [0, 1, 0, 1], peer.records()
        assert all(r["partners"] == 2 for r in landed), peer.records()
        assert all(r["inner_steps"] == 5 for r in peer.records()[:-1])
        payload = sum(r["bytes_sent"] for r in peer.records())
        assert 0 < payload < peer.records()[-1]["transport_sent"], "TCP bytes must include the payload"

    expected = reference_diloco(load_config(TINY, overrides), num_islands=3)
    for peer in peers:
        anchor = load_checkpoint(latest_checkpoint(peer.checkpoint_dir))["anchor"]
        difference = (anchor - expected).abs().max().item()
        rounds = [
            {
                key: r.get(key)
                for key in ("outer_step", "fragment", "staleness", "merge_weights", "resynced", "note", "anchor_digest")
            }
            for island in peers
            for r in island.records()
        ]
        assert difference < 1e-4, f"{peer.name} differs from reference Streaming DiLoCo by {difference}: {rounds}"


def test_late_joiner_starts_from_swarm_anchor(local_swarm: LocalSwarm) -> None:
    local_swarm.bootstrap()
    # The early islands outlast the late one's start-up however slow the machine is; the test stops them.
    args = ["--outer-steps", "200", "--num-shards", "3"]
    early = [local_swarm.peer(f"early-{i}", "--shard-index", str(i), *args) for i in range(2)]
    wait_until(lambda: len(early[0].records()) >= 2, 180, "two outer steps of the early islands")
    late = local_swarm.peer("late", "--shard-index", "2", *args)
    wait_until(lambda: any(r["partners"] > 0 for r in late.records()), 240, "the late joiner to merge")
    for peer in [*early, late]:
        peer.process.send_signal(signal.SIGTERM)
    for peer in [*early, late]:
        assert peer.wait(60) == 143, peer.log_text()[-3000:]

    first = late.records()[0]
    assert first["start_outer_step"] >= 2, "the late joiner did not adopt the swarm's outer step"
    donor_digests = {
        r["anchor_digest"] for peer in early for r in peer.records() if r["outer_step"] == first["start_outer_step"]
    }
    assert first["start_digest"] in donor_digests, "late joiner's starting weights are not the swarm's anchor"
    assert "starting from swarm state" in late.log_text()


def test_killed_island_does_not_stop_the_swarm(local_swarm: LocalSwarm) -> None:
    local_swarm.bootstrap()
    args = ["--outer-steps", "7", "--num-shards", "3", "--averaging-timeout", "8"]
    peers = [local_swarm.peer(f"island-{i}", "--shard-index", str(i), *args) for i in range(3)]
    victim = peers[2]
    wait_until(lambda: len(victim.records()) >= 2, 180, "two outer steps of the victim")
    descendants = psutil.Process(victim.process.pid).children(recursive=True)
    assert any(child.name() == "p2pd" for child in descendants), "expected the victim to own a p2pd daemon"
    victim.process.send_signal(signal.SIGKILL)  # the peer alone, not its session: its children must follow
    _, alive = psutil.wait_procs(descendants, timeout=10)
    assert not alive, f"children of the killed island outlived it: {[p.name() for p in alive]}"

    for peer in peers[:2]:
        assert peer.wait(240) == 0, peer.log_text()[-3000:]
        assert peer.records()[-1]["outer_step"] == 7
        assert "Traceback" not in peer.log_text()


def test_island_of_another_model_is_refused(local_swarm: LocalSwarm) -> None:
    # Two islands agree on the run's model: one island's word would only cost a warning (a forged record could
    # otherwise keep every newcomer out).
    local_swarm.bootstrap()
    args = ["--outer-steps", "4", "--averaging-timeout", "3", "--num-shards", "2"]
    good = [local_swarm.peer(f"good-{i}", *args, "--shard-index", str(i)) for i in range(2)]
    wait_until(lambda: all(len(peer.records()) >= 1 for peer in good), 180, "the first islands to train")
    odd = local_swarm.peer("odd", "--outer-steps", "4", "--d-model", "48")
    assert odd.wait(120) == 2
    lines = [line for line in odd.log_text().splitlines() if "error" in line]
    assert any("model mismatch" in line for line in lines), odd.log_text()[-2000:]
    for peer in good:
        assert peer.wait(240) == 0, peer.log_text()[-3000:]
        assert peer.records()[-1]["outer_step"] == 4


def test_unreachable_bootstrap_fails_fast(local_swarm: LocalSwarm) -> None:
    with socket_port() as port:
        maddr = f"/ip4/127.0.0.1/tcp/{port}/p2p/12D3KooWSY5iuuGuvHRpLGhuEZ3bCdWu75nYxJxcgpvrpuxJDRZV"
    peer = local_swarm.peer("lonely", "--initial-peers", maddr, "--join-timeout", "20", join=False)
    assert peer.wait(90) == 3
    errors = [line for line in peer.log_text().splitlines() if line.startswith("p2p-diloco peer: error")]
    assert len(errors) == 1 and "could not reach any initial peer" in errors[0], peer.log_text()[-2000:]


def socket_port():
    """A context manager yielding a TCP port that nothing listens on once it exits."""
    import contextlib
    import socket

    @contextlib.contextmanager
    def reserve():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            yield sock.getsockname()[1]

    return reserve()


def test_quantized_islands_merge_and_a_codec_mismatch_is_refused(local_swarm: LocalSwarm) -> None:
    local_swarm.bootstrap()
    args = ["--outer-steps", "5", "--num-shards", "2", "--codec", "int8", "--target-group-size", "2"]
    peers = [local_swarm.peer(f"int8-{i}", "--shard-index", str(i), *args) for i in range(2)]
    wait_until(lambda: len(peers[0].records()) >= 1, 180, "the int8 islands to train")
    odd = local_swarm.peer("fp16", "--outer-steps", "5", "--codec", "fp16")
    assert odd.wait(120) == 2
    assert any("codec mismatch" in line for line in odd.log_text().splitlines()), odd.log_text()[-2000:]
    for peer in peers:
        assert peer.wait(240) == 0, peer.log_text()[-3000:]
        records = peer.records()
        assert sum(r["partners"] > 0 for r in records) >= 3
        merged = [r for r in records if r["partners"] > 0]
        # int8 blockwise: about a quarter of the fp32 payload (8 bits + block scales). The averager process counts
        # bytes as they go, so a round's last bytes may land in the next record: compare totals.
        per_round = sum(r["bytes_sent"] for r in records) / len(merged)
        assert 0.1 * 4 * 21_984 < per_round < 0.4 * 4 * 21_984, [r["bytes_sent"] for r in records]


def test_a_lone_island_restarts_from_its_checkpoint_without_waiting_for_donors(local_swarm: LocalSwarm) -> None:
    # Its earlier run's record is still in the DHT, at the step of its checkpoint: no donor can have anything newer,
    # so it must not wait state_wait_s (30 s) for one, as it did.
    local_swarm.bootstrap()
    args = ["--inner-steps", "5", "--state-wait-s", "120"]
    first = local_swarm.peer("island", "--outer-steps", "2", *args, config=TINY)
    assert first.wait(120) == 0, first.log_text()[-3000:]
    again = local_swarm.peer("island", "--outer-steps", "4", *args, config=TINY)
    assert again.wait(120) == 0, again.log_text()[-3000:]
    log = again.log_text()
    assert "starting from checkpoint at outer step 2" in log, log[-3000:]
    assert "no state donor answered yet" not in log, log[-3000:]
    assert again.records()[-1]["outer_step"] == 4
