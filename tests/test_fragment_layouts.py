"""Balanced tensor fragmentation: every value in exactly one fragment, the largest within 4/3 of optimal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from p2p_diloco.config import load_config
from p2p_diloco.diloco.fragments import FragmentError, fragment_layout
from p2p_diloco.train.model import build_model

PEERS = Path(__file__).resolve().parents[1] / "peers"


def models() -> dict[str, torch.nn.Module]:
    """The built-in GPT at two shapes and the shipped tiny Llama."""
    gpt = load_config(None, {"model.n_layers": 6})
    return {
        "gpt-6": build_model(gpt.model, seed=0),
        "gpt-tiny": build_model(load_config(PEERS / "tiny.toml").model, seed=0),
        "tiny-llama": build_model(load_config(PEERS / "tiny-llama.toml").model, seed=0),
    }


@pytest.mark.parametrize("count", [2, 3, 4, 5])
def test_balanced_fragments_partition_the_model_and_stay_within_four_thirds_of_optimal(count: int) -> None:
    for name, model in models().items():
        total = sum(p.numel() for p in model.parameters())
        sizes = [p.numel() for p in model.parameters()]
        if len(sizes) < count:
            continue
        balanced = fragment_layout(model, count, "balanced")
        positions = torch.cat([fragment.index for fragment in balanced]).sort().values
        assert torch.equal(positions, torch.arange(total)), name  # every value once
        assert sum(fragment.size for fragment in balanced) == total
        optimum_bound = max(total / count, max(sizes))  # no split of whole tensors beats this
        peak = max(fragment.size for fragment in balanced)
        assert peak <= (4 / 3) * optimum_bound, (name, peak, optimum_bound)
        try:
            strided = max(fragment.size for fragment in fragment_layout(model, count, "strided"))
        except FragmentError:  # fewer layer blocks than fragments: only tensors can be spread that thin
            continue
        assert peak <= strided, (name, peak, strided)  # never worse than strided layer groups


def test_an_unknown_layout_or_too_many_fragments_is_refused() -> None:
    model = models()["gpt-tiny"]
    with pytest.raises(FragmentError, match="unknown fragment layout"):
        fragment_layout(model, 2, "random")
    with pytest.raises(FragmentError, match="tensors, fewer than"):
        fragment_layout(model, 10_000, "balanced")


def test_the_layout_is_part_of_the_run_fingerprint() -> None:
    from p2p_diloco.island.trainer import run_fingerprint

    model = models()["gpt-tiny"]
    strided = load_config(PEERS / "tiny.toml", {"train.fragments": 2})
    balanced = load_config(PEERS / "tiny.toml", {"train.fragments": 2, "train.fragment_layout": "balanced"})
    assert run_fingerprint(model, strided) != run_fingerprint(model, balanced)
    assert run_fingerprint(model, strided) == run_fingerprint(model, load_config(PEERS / "tiny.toml"))
