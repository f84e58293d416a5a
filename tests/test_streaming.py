"""Streaming DiLoCo pieces without networking: fragments, per-fragment outer steps, transport byte parsing."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.config import ConfigError, ModelConfig, load_config
from p2p_diloco.diloco.fragments import FragmentError, fragment_for_step, fragment_layout
from p2p_diloco.diloco.outer import OuterOptimizer
from p2p_diloco.net.transport import parse_ss
from p2p_diloco.train.model import build_model


def _model(layers: int = 4):
    return build_model(ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=layers, n_heads=2), seed=0)


def test_fragments_cover_every_value_once_with_strided_blocks():
    model = _model(4)
    fragments = fragment_layout(model, 2)
    total = sum(p.numel() for p in model.parameters())
    every = torch.cat([f.index for f in fragments])
    assert every.numel() == total and torch.equal(every.sort().values, torch.arange(total))
    offsets, offset = {}, 0
    for name, parameter in model.named_parameters():
        offsets[name] = offset
        offset += parameter.numel()
    for block in range(4):
        position = offsets[f"blocks.{block}.attn.qkv.weight"]
        owner = [i for i, f in enumerate(fragments) if bool((f.index == position).any())]
        assert owner == [block % 2], f"block {block} is not in fragment {block % 2}"
    sizes = [f.size for f in fragments]
    assert max(sizes) / min(sizes) < 1.3, sizes
    assert sum(sum(f.tensor_sizes) for f in fragments) == total


def test_one_fragment_is_the_whole_model_and_too_many_is_an_error():
    model = _model(1)
    (whole,) = fragment_layout(model, 1)
    flat = torch.arange(sum(p.numel() for p in model.parameters()), dtype=torch.float32)
    assert whole.whole and whole.label is None and whole.size == flat.numel()
    assert torch.equal(whole.take(flat), flat) and whole.take(flat).data_ptr() == flat.data_ptr()  # a view
    with pytest.raises(FragmentError, match="--fragments"):
        fragment_layout(model, 50)


def test_schedule_is_staggered():
    assert [fragment_for_step(step, 3) for step in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_fragment_step_equals_torch_nesterov_on_the_whole_vector():
    anchor = torch.randn(300)
    reference, fragmented = OuterOptimizer(anchor), OuterOptimizer(anchor)
    for _ in range(3):
        gradient = torch.randn(300)
        reference.step(gradient)
        fragmented.step_fragment(gradient, torch.arange(300))
        assert torch.equal(reference.anchor.data, fragmented.anchor.data)
        assert torch.equal(reference.momentum(), fragmented.momentum())


def test_fragment_step_leaves_other_fragments_alone():
    anchor = torch.randn(10)
    outer, alone = OuterOptimizer(anchor, lr=0.5, momentum=0.9), OuterOptimizer(anchor[:4], lr=0.5, momentum=0.9)
    outer.step(torch.ones(10))  # every value gets momentum first
    alone.step(torch.ones(4))
    before_anchor, before_momentum = outer.anchor.data.clone(), outer.momentum().clone()
    index = torch.arange(4)
    gradient = torch.randn(4)
    outer.step_fragment(gradient, index)
    alone.step(gradient)
    assert torch.equal(outer.anchor.data[4:], before_anchor[4:])
    assert torch.equal(outer.momentum()[4:], before_momentum[4:])
    torch.testing.assert_close(outer.anchor.data[:4], alone.anchor.data)
    # by hand: m = 0.9 * 1 + g; anchor -= 0.5 * (g + 0.9 * m)
    momentum = 0.9 * 1.0 + gradient
    torch.testing.assert_close(outer.anchor.data[:4], before_anchor[:4] - 0.5 * (gradient + 0.9 * momentum))


def test_overlap_and_fragment_settings_are_validated():
    with pytest.raises(ConfigError, match="overlap_steps"):
        load_config(None, {"train.inner_steps": 10, "train.fragments": 2, "train.overlap_steps": 6})
    with pytest.raises(ConfigError, match="momentum_every"):
        load_config(None, {"train.fragments": 2, "train.momentum_every": 2})
    with pytest.raises(ConfigError, match="mix_alpha"):
        load_config(None, {"train.mix_alpha": 1.5})
    assert load_config(None, {"train.inner_steps": 10, "train.fragments": 2, "train.overlap_steps": 5})


def test_ss_output_is_parsed_per_socket():
    output = (
        'ESTAB 0 0 127.0.0.1:45599 127.0.0.1:41591 users:(("p2pd",pid=20100,fd=8))\n'
        "\t bbr wscale:10,10 bytes_sent:3150 bytes_retrans:181 bytes_acked:2969 bytes_received:4254 segs_out:62\n"
        'ESTAB 0 0 127.0.0.1:41591 127.0.0.1:45599 users:(("p2pd",pid=20123,fd=12))\n'
        "\t cubic bytes_sent:10 bytes_received:20\n"
    )
    assert parse_ss(output) == {
        ("127.0.0.1:45599", "127.0.0.1:41591", 20100): (3150, 4254),
        ("127.0.0.1:41591", "127.0.0.1:45599", 20123): (10, 20),
    }


def test_example_configs_load_and_split(tmp_path) -> None:
    from pathlib import Path

    examples = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.toml"))
    assert examples, "examples/ holds no peer configuration"
    for path in examples:
        config = load_config(path)
        model = build_model(config.model, seed=0)
        fragments = fragment_layout(model, config.train.fragments)
        assert sum(f.size for f in fragments) == sum(p.numel() for p in model.parameters()), path
