"""Fast tests of the tiny transformer and the byte-level data pipeline."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from p2p_diloco.config import DataConfig, ModelConfig
from p2p_diloco.train.data import (
    BatchStream,
    DataError,
    evaluate,
    load_corpus,
    load_shards,
    split_corpus,
)
from p2p_diloco.train.model import TinyGPT, build_model, count_parameters, model_fingerprint

SMALL = ModelConfig(seq_len=16, d_model=32, n_layers=1, n_heads=2, mlp_ratio=2)


def random_batch(config: ModelConfig, batch: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random byte ids and next-byte targets of the model's full length."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, config.vocab_size, (batch, config.seq_len + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


# ---- model ----


def test_build_model_is_deterministic_per_seed():
    a, b, c = build_model(SMALL, seed=1), build_model(SMALL, seed=1), build_model(SMALL, seed=2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["tok_emb.weight"], sc["tok_emb.weight"])
    assert not torch.equal(sa["blocks.0.attn.qkv.weight"], sc["blocks.0.attn.qkv.weight"])


def test_build_model_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model(SMALL, seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_init_statistics():
    model = build_model(ModelConfig(), seed=0)
    qkv = model.blocks[0].attn.qkv
    assert abs(qkv.weight.std().item() - 0.02) < 0.002
    assert torch.count_nonzero(qkv.bias) == 0
    assert model.lm_head.weight is model.tok_emb.weight


def test_fingerprint_identifies_architecture_not_values():
    fp = model_fingerprint(build_model(SMALL, seed=0))
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert model_fingerprint(build_model(SMALL, seed=5)) == fp
    wider = ModelConfig(seq_len=16, d_model=64, n_layers=1, n_heads=2, mlp_ratio=2)
    assert model_fingerprint(build_model(wider, seed=0)) != fp


def test_count_parameters_counts_tied_weights_once():
    c = SMALL
    d, h = c.d_model, c.mlp_ratio * c.d_model
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)
    expected = c.vocab_size * d + c.seq_len * d + c.n_layers * block + 2 * d
    assert count_parameters(build_model(c, seed=0)) == expected


def test_forward_shapes_and_initial_loss():
    model = build_model(ModelConfig(), seed=0)
    x, y = random_batch(ModelConfig())
    logits, loss = model(x, y)
    assert logits.shape == (4, 64, 256)
    assert abs(loss.item() - math.log(256)) < 0.3
    logits_only, no_loss = model(x[:, :10])
    assert logits_only.shape == (4, 10, 256) and no_loss is None


def test_forward_rejects_too_long_sequence():
    model = TinyGPT(SMALL)
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, SMALL.seq_len + 1, dtype=torch.long))


def test_a_few_adamw_steps_reduce_loss():
    model = build_model(SMALL, seed=0)
    x, y = random_batch(SMALL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = model(x, y)[1].item()
    for _ in range(20):
        optimizer.zero_grad()
        model(x, y)[1].backward()
        optimizer.step()
    assert model(x, y)[1].item() < first - 1.0


def test_attention_is_causal():
    model = build_model(SMALL, seed=0)
    x, _ = random_batch(SMALL, batch=2)
    changed = x.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    before, after = model(x)[0], model(changed)[0]
    torch.testing.assert_close(before[:, :10], after[:, :10], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, 10:], after[:, 10:])


# ---- corpus ----


def test_default_corpus_is_stdlib_source_capped_and_deterministic():
    corpus = load_corpus(None, max_bytes=100_000)
    assert corpus.dtype == torch.uint8 and 0 < len(corpus) <= 100_000
    assert torch.equal(corpus, load_corpus(None, max_bytes=100_000))
    first = sorted(p for p in Path(os.__file__).parent.glob("*.py") if p.is_file())[0]
    head = first.read_bytes()[:1000]
    assert bytes(corpus[: len(head)].tolist()) == head


def test_file_and_folder_paths(tmp_path):
    file = tmp_path / "one.txt"
    file.write_bytes(b"hello world")
    assert bytes(load_corpus(str(file), max_bytes=1000).tolist()) == b"hello world"
    assert bytes(load_corpus(str(file), max_bytes=5).tolist()) == b"hello"

    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.md").write_bytes(b"BBB")
    (folder / "a.txt").write_bytes(b"AAA")
    (folder / "sub" / "c.rst").write_bytes(b"CCC")
    (folder / "skip.bin").write_bytes(b"XXX")
    assert bytes(load_corpus(str(folder), max_bytes=1000).tolist()) == b"AAABBBCCC"


def test_missing_path_and_empty_corpus_raise_data_error(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match=str(missing)):
        load_corpus(str(missing), max_bytes=1000)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "x.bin").write_bytes(b"not text")
    with pytest.raises(DataError, match="no text"):
        load_corpus(str(tmp_path / "empty"), max_bytes=1000)
    assert issubclass(DataError, ValueError)


# ---- shards ----


def test_shards_are_equal_disjoint_and_eval_is_the_tail():
    corpus = torch.arange(1003).to(torch.uint8)
    shards = split_corpus(corpus, eval_fraction=0.1)
    assert len(shards.eval) == 100 and torch.equal(shards.eval, corpus[-100:])
    assert len(shards.train) + len(shards.eval) == len(corpus)
    parts = [shards.train_shard(i, 3) for i in range(3)]
    assert {len(p) for p in parts} == {301}
    # views of one buffer: disjoint if their storage offsets never overlap
    offsets = [p.storage_offset() for p in parts]
    assert offsets == [0, 301, 602]
    with pytest.raises(DataError):
        shards.train_shard(3, 3)


def test_load_shards_uses_config(tmp_path):
    file = tmp_path / "t.txt"
    file.write_bytes(bytes(range(1, 201)) * 5)
    shards = load_shards(DataConfig(path=str(file), eval_fraction=0.25, max_bytes=800))
    assert len(shards.train) == 600 and len(shards.eval) == 200


# ---- batches ----


def test_batch_stream_is_deterministic_and_shifted():
    tokens = load_corpus(None, max_bytes=20_000)
    a, b = BatchStream(tokens, 4, 16, seed=3), BatchStream(tokens, 4, 16, seed=3)
    other = BatchStream(tokens, 4, 16, seed=4)
    assert a.tokens_per_batch == 64
    for _ in range(3):
        (xa, ya), (xb, yb) = a.next_batch(), b.next_batch()
        assert xa.dtype == torch.int64 and xa.shape == (4, 16)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])
    assert not torch.equal(a.next_batch()[0], other.next_batch()[0])


def test_batch_stream_resumes_from_state_dict():
    tokens = load_corpus(None, max_bytes=20_000)
    stream = BatchStream(tokens, 4, 16, seed=0)
    for _ in range(5):
        stream.next_batch()
    state = stream.state_dict()
    expected = stream.next_batch()
    restarted = BatchStream(tokens, 4, 16, seed=0)
    restarted.load_state_dict(state)
    assert restarted.state_dict()["batches"] == 5
    resumed = restarted.next_batch()
    assert torch.equal(resumed[0], expected[0]) and torch.equal(resumed[1], expected[1])


def test_short_shard_raises_data_error():
    with pytest.raises(DataError, match="seq_len"):
        BatchStream(torch.zeros(16, dtype=torch.uint8), batch_size=2, seq_len=16, seed=0)


# ---- evaluation ----


def test_evaluate_is_deterministic_and_restores_mode():
    model = build_model(SMALL, seed=0)
    eval_tokens = load_corpus(None, max_bytes=5_000)
    model.train()
    first = evaluate(model, eval_tokens, seq_len=16, batch_size=4, num_batches=3)
    assert model.training
    assert evaluate(model, eval_tokens, seq_len=16, batch_size=4, num_batches=3) == first
    assert abs(first - math.log(256)) < 0.3
    model.eval()
    evaluate(model, eval_tokens, seq_len=16, batch_size=4, num_batches=3)
    assert not model.training
