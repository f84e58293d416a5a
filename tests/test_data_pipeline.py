"""The datasets pipeline: a tokenizer trained here, JSONL / Parquet / text folders, packing, shards, eval, resume.

Nothing is downloaded: the corpus is Python's standard library, the tokenizer is trained on it in the test.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from p2p_diloco.config import load_config
from p2p_diloco.errors import UserError
from p2p_diloco.train.sources import prepare_data
from p2p_diloco.train.tokenizer import load_tokenizer

STDLIB = sorted(Path(os.__file__).parent.glob("*.py"))[:30]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A BPE tokenizer trained on the stdlib, and the same documents as JSONL, Parquet and a folder of .txt."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("corpus")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(p) for p in STDLIB], trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    texts = [p.read_text() for p in STDLIB]
    (folder / "docs.jsonl").write_text("".join(json.dumps({"body": t, "n": i}) + "\n" for i, t in enumerate(texts)))
    pq.write_table(pa.table({"body": texts}), folder / "docs.parquet")
    (folder / "texts").mkdir()
    for i, text in enumerate(texts):
        (folder / "texts" / f"{i:03d}.txt").write_text(text)
    return {"folder": folder, "tokenizer": folder / "tokenizer.json"}


def config_for(corpus: dict[str, Path], data: str, **overrides):
    values = {
        "model.seq_len": 32,
        "model.vocab_size": 400,
        "data.path": str(corpus["folder"] / data),
        "data.tokenizer": str(corpus["tokenizer"]),
        "data.text_field": "body",
        "data.cache_dir": str(corpus["folder"] / "cache"),
        "data.eval_batches": 2,
        "train.batch_size": 4,
        **overrides,
    }
    return load_config(None, values)


def test_the_tokenizer_names_its_end_of_text_and_vocabulary(corpus: dict[str, Path]) -> None:
    tokenizer = load_tokenizer(str(corpus["tokenizer"]))
    assert tokenizer.vocab_size == 400 and tokenizer.eos_id == 0  # the first special token
    ids = tokenizer.encode_batch(["def f(x):\n    return x\n"])[0]
    assert tokenizer.decode(ids) == "def f(x):\n    return x\n" and len(ids) < 20


@pytest.mark.parametrize("data", ["docs.jsonl", "docs.parquet", "texts"])
def test_each_format_packs_into_disjoint_shards_and_one_eval_split(corpus: dict[str, Path], data: str) -> None:
    overrides = {} if data != "texts" else {"data.text_field": "text"}
    prepared = prepare_data(config_for(corpus, data, **overrides))
    streams = [prepared.open(index, 2, seed=index) for index in range(2)]
    shards = [set(stream.indices.tolist()) for stream in streams]
    assert shards[0] and shards[1] and not shards[0] & shards[1]
    blocks = prepared.open(0, 1, seed=0).blocks
    every = 20  # eval_fraction 0.05: every 20th block is held out
    assert not any(index % every == 0 for shard in shards for index in shard)
    x, y = prepared.eval_batches[0]
    assert x.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    every_block = np.asarray(blocks[:]["input_ids"])
    assert len(every_block) > 500 and every_block.shape[1] == 33
    # Each of the 30 documents ends with the end-of-text token (the last batch's leftover tokens are dropped).
    assert 28 <= int((every_block == 0).sum()) <= 30


def test_formats_agree_and_the_eval_split_is_the_same_on_every_island(corpus: dict[str, Path]) -> None:
    jsonl = prepare_data(config_for(corpus, "docs.jsonl", **{"data.shard_index": 0, "data.num_shards": 2}))
    parquet = prepare_data(config_for(corpus, "docs.parquet", **{"data.shard_index": 1, "data.num_shards": 2}))
    for (a, _), (b, _) in zip(jsonl.eval_batches, parquet.eval_batches):
        assert torch.equal(a, b)
    first = jsonl.open(0, 2, seed=0).next_batch()[0]
    assert torch.equal(first, parquet.open(0, 2, seed=0).next_batch()[0])


def test_a_resumed_stream_continues_at_its_saved_position(corpus: dict[str, Path]) -> None:
    prepared = prepare_data(config_for(corpus, "docs.jsonl"))
    stream = prepared.open(1, 2, seed=7)
    for _ in range(len(stream.indices) // 4 + 5):  # past the end of an epoch of this shard
        stream.next_batch()
    saved = stream.state_dict()
    expected = [stream.next_batch()[0] for _ in range(3)]
    resumed = prepared.open(1, 2, seed=7)
    resumed.load_state_dict(saved)
    assert saved["epoch"] >= 1
    assert all(torch.equal(a, resumed.next_batch()[0]) for a in expected)


def test_a_streamed_corpus_shards_evaluates_and_resumes(corpus: dict[str, Path]) -> None:
    prepared = prepare_data(config_for(corpus, "docs.jsonl", **{"data.streaming": True}))
    again = prepare_data(config_for(corpus, "docs.jsonl", **{"data.streaming": True}))
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(prepared.eval_batches, again.eval_batches))
    streams = [prepared.open(index, 2, seed=0) for index in range(2)]
    seen = [{tuple(row.tolist()) for _ in range(20) for row in stream.next_batch()[0]} for stream in streams]
    assert not seen[0] & seen[1]
    stream = streams[0]
    saved = stream.state_dict()
    expected = [stream.next_batch()[0] for _ in range(3)]
    resumed = prepared.open(0, 2, seed=0)
    resumed.load_state_dict(saved)
    assert all(torch.equal(a, resumed.next_batch()[0]) for a in expected)


def test_the_peer_id_picks_a_shard_when_only_the_count_is_given(corpus: dict[str, Path]) -> None:
    config = config_for(corpus, "docs.jsonl", **{"data.num_shards": 3})
    prepared = prepare_data(config)
    stream, shard = prepared.stream(config, "QmSomePeer")
    assert "picked by peer id" in shard and np.isin(stream.indices, prepared.open(0, 1, 0).indices).all()


@pytest.mark.parametrize(
    ("data", "overrides", "message"),
    [
        ("docs.jsonl", {"data.text_field": "text"}, "has no field 'text' (it has body, n); set data.text_field"),
        ("empty.jsonl", {}, "holds no documents"),
        ("latin1.txt", {"data.text_field": "text"}, "text files must be UTF-8"),
        ("broken.jsonl", {}, "each line of a .jsonl file must be one JSON object"),
        ("missing.jsonl", {}, "does not exist"),
        ("mixed", {}, "mixes json and parquet files"),
        ("docs.jsonl", {"data.tokenizer": "nope.json"}, "data.tokenizer nope.json does not exist"),
        ("docs.jsonl", {"data.eos_token": "<eos>"}, "has no token '<eos>'"),
        ("docs.jsonl", {"model.seq_len": 1_000_000}, "too few for a training and an eval split"),
    ],
)
def test_bad_data_is_a_one_line_error(corpus: dict[str, Path], data: str, overrides: dict, message: str) -> None:
    folder = corpus["folder"]
    (folder / "empty.jsonl").write_text("")
    (folder / "latin1.txt").write_bytes("café crème\n".encode("latin-1"))
    (folder / "broken.jsonl").write_text("not json\n")
    (folder / "mixed").mkdir(exist_ok=True)
    (folder / "mixed" / "a.jsonl").write_text('{"body": "a"}\n')
    (folder / "mixed" / "b.parquet").write_bytes((folder / "docs.parquet").read_bytes())
    with pytest.raises(UserError) as caught:
        prepare_data(config_for(corpus, data, **overrides))
    assert message in str(caught.value) and "\n" not in str(caught.value), str(caught.value)
