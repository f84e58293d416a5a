"""What an island trains on: its shard's batch stream and the held-out eval batches, the same on every island.

Two pipelines behind one interface. With the bytes tokenizer and text files (or the built-in corpus) it is the
original byte pipeline (`p2p_diloco.train.data`: the corpus in memory, random windows). Any other tokenizer, or
JSON lines and Parquet files, go through Hugging Face datasets (`documents`, `packing`).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from p2p_diloco.config import PeerConfig
from p2p_diloco.train.data import BatchStream, DataError, data_seed, eval_windows, load_shards
from p2p_diloco.train.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]


class Stream(Protocol):
    """A resumable stream of training batches."""

    tokens_per_batch: int

    def next_batch(self) -> Batch: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainingData:
    """The run's data as this machine prepared it: the tokenizer, the eval batches, and each shard's stream."""

    tokenizer: Tokenizer
    eval_batches: list[Batch]
    open: Callable[[int, int, int, int], Stream]
    """open(shard index, shard count, seed, rows): the training stream of one shard, `rows` sequences a batch."""

    def stream(self, config: PeerConfig, peer_id: str, rows: int | None = None) -> tuple[Stream, str]:
        """This island's stream (batches of `rows` sequences, default batch_size) and which shard it reads."""
        data, train = config.data, config.train
        rows = rows or train.batch_size
        if data.shard_index is None and data.num_shards == 1:
            return self.open(0, 1, data_seed(train.seed, None, peer_id), rows), "the whole corpus"
        index, count = shard_of(config, peer_id)
        shard = f"shard {index} of {count}" + ("" if data.shard_index is not None else " (picked by peer id)")
        return self.open(index, count, data_seed(train.seed, index, peer_id), rows), shard


def shard_of(config: PeerConfig, peer_id: str) -> tuple[int, int]:
    """(index, count) of this island's shard: --shard-index, or from the peer id when only --num-shards is set."""
    data = config.data
    if data.shard_index is not None:
        return data.shard_index, data.num_shards
    return zlib.crc32(peer_id.encode()) % data.num_shards, data.num_shards


def uses_byte_pipeline(config: PeerConfig) -> bool:
    """True for today's byte pipeline: the bytes tokenizer on text files or the built-in corpus."""
    from p2p_diloco.train.documents import corpus_files

    if config.data.tokenizer != "bytes" or config.data.streaming:
        return False
    return config.data.path is None or corpus_files(config.data.path)[0] == "text"


def prepare_data(config: PeerConfig, tokenizer: Tokenizer | None = None) -> TrainingData:
    """Load (and on first use tokenize and pack) the corpus, and cut the eval batches every island shares."""
    data, train, seq_len = config.data, config.train, config.model.seq_len
    if uses_byte_pipeline(config):
        shards = load_shards(data)
        batches = eval_windows(shards.eval, seq_len, train.batch_size, data.eval_batches)

        def open_bytes(index: int, count: int, seed: int, rows: int = train.batch_size) -> Stream:
            tokens = shards.train if count == 1 else shards.train_shard(index, count)
            return BatchStream(tokens, rows, seq_len, seed)

        return TrainingData(ByteTokenizer(), batches, open_bytes)
    tokenizer = tokenizer or load_tokenizer(data.tokenizer, data.eos_token)
    return (_streamed if data.streaming else _prepared)(config, tokenizer)


def _documents(config: PeerConfig) -> Any:
    from p2p_diloco.train.documents import load_documents

    data = config.data
    return load_documents(data.path, text_field=data.text_field, streaming=data.streaming, cache_dir=data.cache_dir)


def _as_batches(inputs: torch.Tensor, targets: torch.Tensor, batch_size: int) -> list[Batch]:
    if len(inputs) == 0:
        raise DataError("the eval split holds no block; raise data.eval_fraction or add data")
    return list(zip(inputs.split(batch_size), targets.split(batch_size)))


def _prepared(config: PeerConfig, tokenizer: Tokenizer) -> TrainingData:
    from p2p_diloco.train.packing import BlockStream, batch_of, eval_every, packed_blocks, split_blocks

    data, train, seq_len = config.data, config.train, config.model.seq_len
    every = eval_every(data.eval_fraction)
    blocks = packed_blocks(_documents(config), tokenizer, data.text_field, seq_len)
    held_out, _ = split_blocks(len(blocks), every, 0, 1)
    wanted = min(train.batch_size * data.eval_batches, len(held_out))
    chosen = np.unique(held_out[np.linspace(0, len(held_out) - 1, wanted).round().astype(int)])
    batches = _as_batches(*batch_of(blocks[chosen]["input_ids"]), train.batch_size)
    logger.info(f"corpus: {len(blocks):,} blocks of {seq_len + 1} tokens, {len(held_out):,} held out for eval")

    def open_blocks(index: int, count: int, seed: int, rows: int = train.batch_size) -> Stream:
        return BlockStream(blocks, split_blocks(len(blocks), every, index, count)[1], rows, seed)

    return TrainingData(tokenizer, batches, open_blocks)


def _streamed(config: PeerConfig, tokenizer: Tokenizer) -> TrainingData:
    from datasets.distributed import split_dataset_by_node

    from p2p_diloco.train.packing import StreamedBlocks, eval_every

    data, train, seq_len = config.data, config.train, config.model.seq_len
    every = eval_every(data.eval_fraction)

    def held_out() -> Any:
        return _documents(config).filter(lambda _, i: i % every == 0, with_indices=True)

    probe = StreamedBlocks(held_out, tokenizer, data.text_field, seq_len, train.batch_size * data.eval_batches)
    batches = _as_batches(*probe.next_batch(), train.batch_size)

    def open_stream(index: int, count: int, seed: int, rows: int = train.batch_size) -> Stream:
        def shard() -> Any:
            training = _documents(config).filter(lambda _, i: i % every != 0, with_indices=True)
            return split_dataset_by_node(training, rank=index, world_size=count)

        return StreamedBlocks(shard, tokenizer, data.text_field, seq_len, rows)

    return TrainingData(tokenizer, batches, open_stream)
