"""Tokenized documents packed into blocks of seq_len + 1 tokens, with the end-of-text token between documents.

A prepared corpus is tokenized and packed once per machine into the Arrow cache (with a progress bar), then split
by block: every K-th block (K = 1 / eval_fraction) is held out, so the eval blocks are the same on every island;
the other blocks are cut into `num_shards` contiguous, disjoint shards. An island reads its shard in a seeded
random order, epoch after epoch; its position (epoch, cursor) resumes exactly from a checkpoint.

A streamed corpus is split by document instead (every K-th document is held out; the others are dealt to the
shards in turn), packed as it is read, and resumed from the stream's own state plus the tokens not yet packed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from p2p_diloco.train.data import DataError
from p2p_diloco.train.tokenizer import Tokenizer

Batch = tuple[torch.Tensor, torch.Tensor]


def eval_every(eval_fraction: float) -> int:
    """K: one block (or document) in K is held out for evaluation."""
    if not 0 < eval_fraction < 1:
        raise DataError(f"data.eval_fraction={eval_fraction} must be in (0, 1) to hold out an eval split")
    return max(2, round(1 / eval_fraction))


def pack(token_lists: list[list[int]], eos_id: int, block: int, carry: list[int] | None = None) -> tuple:
    """Concatenate documents (each followed by eos) after `carry`; returns (blocks of `block` tokens, rest)."""
    flat = list(carry or [])
    for ids in token_lists:
        flat.extend(ids)
        flat.append(eos_id)
    whole = len(flat) // block * block
    return [flat[i : i + block] for i in range(0, whole, block)], flat[whole:]


def batch_of(blocks: np.ndarray | list[list[int]]) -> Batch:
    """(inputs, targets) int64 [n, seq_len] from blocks of seq_len + 1 tokens."""
    tensor = torch.as_tensor(np.asarray(blocks, dtype=np.int64))
    return tensor[:, :-1], tensor[:, 1:]


def packed_blocks(documents: Any, tokenizer: Tokenizer, text_field: str, seq_len: int) -> Any:
    """The corpus as a dataset of `input_ids` blocks of seq_len + 1 tokens, cached in Arrow (map-style corpora)."""
    block = seq_len + 1

    def tokenize_and_pack(batch: dict[str, list]) -> dict[str, list]:
        texts = [text if isinstance(text, str) else "" for text in batch[text_field]]
        return {"input_ids": pack(tokenizer.encode_batch(texts), tokenizer.eos_id, block)[0]}

    # datasets would hash the closure (and the tokenizer object in it) to name its cache; this names it exactly.
    fingerprint = hashlib.blake2b(
        f"{documents._fingerprint}|{tokenizer.fingerprint}|{tokenizer.eos_id}|{block}|{text_field}".encode(),
        digest_size=16,
    ).hexdigest()
    blocks = documents.map(
        tokenize_and_pack,
        batched=True,
        batch_size=1000,
        remove_columns=documents.column_names,
        new_fingerprint=fingerprint,
        desc="tokenizing and packing",
    )
    if len(blocks) < 2:
        raise DataError(
            f"the corpus packs into {len(blocks)} block(s) of seq_len + 1 = {block} tokens, too few for a training "
            "and an eval split; add text or use a shorter model.seq_len"
        )
    return blocks.with_format("numpy")


class BlockStream:
    """An island's shard of packed blocks, in a seeded random order per epoch; resumable via state_dict."""

    def __init__(self, blocks: Any, indices: np.ndarray, batch_size: int, seed: int):
        if len(indices) == 0:
            raise DataError("this island's shard holds no blocks; use fewer shards or more data")
        self.blocks, self.indices, self.batch_size, self.seed = blocks, indices, batch_size, seed
        self.epoch, self.cursor, self.batches = 0, 0, 0
        self.order = self._order()

    def _order(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.indices)

    @property
    def tokens_per_batch(self) -> int:
        """Input tokens in one batch."""
        return self.batch_size * (len(self.blocks[0]["input_ids"]) - 1)

    def next_batch(self) -> Batch:
        """The next batch_size blocks of the shard (wrapping into the next epoch's order)."""
        chosen = []
        while len(chosen) < self.batch_size:
            if self.cursor == len(self.order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self.order = self._order()
            take = min(self.batch_size - len(chosen), len(self.order) - self.cursor)
            chosen.extend(self.order[self.cursor : self.cursor + take].tolist())
            self.cursor += take
        self.batches += 1
        return batch_of(self.blocks[sorted(chosen)]["input_ids"])

    def state_dict(self) -> dict[str, Any]:
        """Where the stream is: enough to resume it exactly."""
        return {"epoch": self.epoch, "cursor": self.cursor, "batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a state_dict() of a stream over the same shard."""
        self.epoch, self.cursor, self.batches = int(state["epoch"]), int(state["cursor"]), int(state["batches"])
        self.order = self._order()


def split_blocks(count: int, every: int, shard_index: int, num_shards: int) -> tuple[np.ndarray, np.ndarray]:
    """(eval block ids, this shard's training block ids): every `every`-th block is eval, the rest cut in shards."""
    ids = np.arange(count)
    held_out = ids % every == 0
    train = ids[~held_out]
    size = len(train) // num_shards
    if size == 0:
        raise DataError(f"{len(train)} training blocks cannot make {num_shards} shards; use fewer shards or more data")
    return ids[held_out], train[shard_index * size : (shard_index + 1) * size]


class StreamedBlocks:
    """Packed blocks of a streamed corpus (one shard of its documents), in order; resumable via state_dict."""

    def __init__(
        self, make_documents: Callable[[], Any], tokenizer: Tokenizer, text_field: str, seq_len: int, batch_size: int
    ):
        self.make_documents, self.tokenizer, self.text_field = make_documents, tokenizer, text_field
        self.block, self.batch_size = seq_len + 1, batch_size
        self.epoch, self.batches, self.carry = 0, 0, []
        self.pending: list[list[int]] = []
        self._documents = make_documents()
        self._iterator: Iterator | None = None

    @property
    def tokens_per_batch(self) -> int:
        """Input tokens in one batch."""
        return self.batch_size * (self.block - 1)

    def _next_document(self) -> str:
        for restarted in (False, True):
            if self._iterator is None:
                self._iterator = iter(self._documents)
            for record in self._iterator:
                text = record.get(self.text_field)
                return text if isinstance(text, str) else ""
            if restarted:
                break
            self.epoch, self._iterator = self.epoch + 1, None  # the shard is exhausted: the next epoch
            self._documents = self.make_documents()
        raise DataError("this island's shard of the streamed corpus holds no documents; use fewer shards")

    def next_batch(self) -> Batch:
        """The next batch_size blocks of the stream."""
        while len(self.pending) < self.batch_size:
            ids = self.tokenizer.encode_batch([self._next_document()])
            blocks, self.carry = pack(ids, self.tokenizer.eos_id, self.block, self.carry)
            self.pending.extend(blocks)
        chosen, self.pending = self.pending[: self.batch_size], self.pending[self.batch_size :]
        self.batches += 1
        return batch_of(chosen)

    def state_dict(self) -> dict[str, Any]:
        """The stream's own position plus the tokens and blocks read but not yet trained on."""
        return {
            "epoch": self.epoch,
            "batches": self.batches,
            "documents": self._documents.state_dict(),
            "carry": list(self.carry),
            "pending": [list(block) for block in self.pending],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a state_dict() of a stream over the same shard."""
        self.epoch, self.batches = int(state["epoch"]), int(state["batches"])
        self._documents = self.make_documents()
        self._documents.load_state_dict(state["documents"])
        self._iterator = None
        self.carry, self.pending = list(state["carry"]), [list(block) for block in state["pending"]]
