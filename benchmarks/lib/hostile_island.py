"""A hostile island: the project's own peer with one function replaced, for the attack tests and benchmark.

    python benchmarks/lib/hostile_island.py ATTACK [p2p-diloco peer flags...]

Attacks on the merge (what the island sends): scale (pseudo-gradient x1000), noise (Gaussian, 100x the honest
norm), flip (sign-flipped x10), nan (NaN in 10 entries), tokens (claims 1000x its tokens), clock (claims the swarm
is at step 10**6). Attacks on newcomers (what it serves as a state donor): donor-random (a random anchor under a
newer step), donor-nan (an all-NaN anchor), donor-shape (a state of another shape). `random-data` trains on
random bytes (a stranger with the run id).
"""

from __future__ import annotations

import sys

import torch

from p2p_diloco.cli.main import main
from p2p_diloco.diloco.outer import state_digest
from p2p_diloco.island import contribution, island, outer_state

MERGE_ATTACKS = ("scale", "noise", "flip", "nan", "tokens", "clock")
DONOR_ATTACKS = ("donor-random", "donor-nan", "donor-shape")
ATTACKS = (*MERGE_ATTACKS, *DONOR_ATTACKS, "random-data")


def poison_payload(attack: str) -> None:
    honest = contribution.Contribution.payload

    def payload(self) -> torch.Tensor:
        values = honest(self)
        if attack == "scale":
            return values * 1000
        if attack == "noise":
            return torch.randn_like(values) * 100 * values.norm() / values.numel() ** 0.5
        if attack == "flip":
            return -10 * values
        poisoned = values.clone()
        poisoned[:10] = float("nan")
        return poisoned

    contribution.Contribution.payload = payload


def lie_in_metadata(attack: str) -> None:
    honest = island.Island._contribution

    def lying(self, *args, **kwargs):
        made = honest(self, *args, **kwargs)
        if attack == "tokens":
            made.metadata["tokens"] *= 1000
            made.metadata["base_weight"] *= 1000**2  # w = c_tokens * (c_tokens / c_steps)
        else:
            made.metadata["swarm_step"] = 10**6
        return made

    island.Island._contribution = lying


def lie_as_donor(attack: str) -> None:
    honest = outer_state.OuterState.for_peers

    def for_peers(self, with_tensors: bool = True):
        metadata, tensors = honest(self)
        if attack == "donor-random":
            tensors = [torch.randn_like(tensor) for tensor in tensors]
        elif attack == "donor-nan":
            tensors = [torch.full_like(tensor, float("nan")) for tensor in tensors]
        else:
            tensors = [torch.randn(tensor.numel() + 7) for tensor in tensors]
        metadata = {**metadata, "outer_step": metadata["outer_step"] + 100, "digest": state_digest(*tensors)}
        return metadata, tensors if with_tensors else []

    outer_state.OuterState.for_peers = for_peers


def train_on_random_bytes() -> None:
    from p2p_diloco.train import data

    original = data.load_corpus

    def random_corpus(path, max_bytes):
        return torch.randint(0, 256, (len(original(path, max_bytes)),), dtype=torch.uint8)

    data.load_corpus = random_corpus


if __name__ == "__main__":
    attack, *argv = sys.argv[1:]
    if attack not in ATTACKS:
        raise SystemExit(f"unknown attack {attack!r}; choose one of {', '.join(ATTACKS)}")
    if attack in ("scale", "noise", "flip", "nan"):
        poison_payload(attack)
    elif attack in ("tokens", "clock"):
        lie_in_metadata(attack)
    elif attack in DONOR_ATTACKS:
        lie_as_donor(attack)
    else:
        train_on_random_bytes()
    raise SystemExit(main(["peer", *argv]))
