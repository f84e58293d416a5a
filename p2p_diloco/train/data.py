"""Byte-level text data: a corpus that needs no download, equal shards per island, batches and evaluation."""

from __future__ import annotations

import contextlib
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from p2p_diloco.config import DataConfig
from p2p_diloco.errors import UserError

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")


Batch = tuple[torch.Tensor, torch.Tensor]
Autocast = Callable[[], contextlib.AbstractContextManager]
"""Makes the context the forward pass runs in (a precision's autocast)."""


class DataError(UserError, ValueError):
    """Text data the user must fix; the message says what."""


def _builtin_files() -> list[Path]:
    """The standard library's top-level .py files, sorted: the same text on every machine with this Python."""
    folder = Path(os.__file__).parent
    return sorted(p for p in folder.glob("*.py") if p.is_file())


def _folder_files(folder: Path) -> list[Path]:
    """Text files under a folder, recursively, sorted by relative path so every island reads one order."""
    files = [p for p in folder.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES]
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def _read_capped(files: list[Path], max_bytes: int) -> bytes:
    """Concatenate file bytes in order, stopping once max_bytes are read."""
    chunks, total = [], 0
    for file in files:
        if total >= max_bytes:
            break
        data = file.read_bytes()[: max_bytes - total]
        if b"\x00" in data[:65536]:
            raise DataError(f"{file} looks binary (it holds NUL bytes); point --data at text files")
        chunks.append(data)
        total += len(data)
    return b"".join(chunks)


def load_corpus(path: str | None, max_bytes: int) -> torch.Tensor:
    """uint8 tensor of the corpus bytes: a file, a folder of text files, or (None) Python's stdlib source."""
    if max_bytes < 1:
        raise DataError(f"data.max_bytes={max_bytes} must be >= 1")
    if path is None:
        files, where = _builtin_files(), f"the built-in corpus ({Path(os.__file__).parent})"
    else:
        source = Path(path).expanduser()
        if source.is_file():
            files = [source]
            where = f"data.path {path}"
        elif source.is_dir():
            files = _folder_files(source)
            where = f"data.path {path} (files ending in {', '.join(TEXT_SUFFIXES)})"
        else:
            raise DataError(f"data.path {path} does not exist; point it at a text file or a folder of text files")
    data = _read_capped(files, max_bytes)
    if not data:
        raise DataError(f"{where} holds no text; add some text or point data.path elsewhere")
    # bytearray gives frombuffer a writable buffer; clone so the tensor owns its memory
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def data_seed(seed: int, shard_index: int | None, peer_id: str) -> int:
    """Batch-order seed: fixed by (seed, shard) when the shard is given, else unique to the peer."""
    if shard_index is not None:
        return seed * 1_000_003 + shard_index + 1
    return seed * 1_000_003 + zlib.crc32(peer_id.encode())


@dataclass
class Shards:
    """The training text, cut into shards per island, and the held-out tail shared by all islands."""

    train: torch.Tensor
    """uint8, the first (1 - eval_fraction) of the corpus."""
    eval: torch.Tensor
    """uint8, the tail: the same held-out text for every island."""

    def train_shard(self, index: int, count: int) -> torch.Tensor:
        """Contiguous shard `index` of `count` equal-size shards of train (the remainder is dropped)."""
        if count < 1 or not 0 <= index < count:
            raise DataError(f"shard index {index} must be in [0, {count}) with a shard count >= 1")
        size = len(self.train) // count
        if size == 0:
            raise DataError(f"{len(self.train)} training bytes cannot make {count} shards; use fewer shards")
        return self.train[index * size : (index + 1) * size]


def split_corpus(corpus: torch.Tensor, eval_fraction: float) -> Shards:
    """Split a corpus into its training head and held-out tail."""
    if not 0 <= eval_fraction < 1:
        raise DataError(f"data.eval_fraction={eval_fraction} must be in [0, 1)")
    n_eval = int(len(corpus) * eval_fraction)
    n_train = len(corpus) - n_eval
    if n_train == 0:
        raise DataError("the corpus has no training text left after the eval split; add text")
    return Shards(train=corpus[:n_train], eval=corpus[n_train:])


def load_shards(config: DataConfig) -> Shards:
    """Load the configured corpus and split off the held-out tail."""
    return split_corpus(load_corpus(config.path, config.max_bytes), config.eval_fraction)


def _check_length(tokens: torch.Tensor, seq_len: int, what: str) -> None:
    """Raise DataError unless tokens hold at least one (input, target) window."""
    if len(tokens) < seq_len + 1:
        raise DataError(
            f"{what} has {len(tokens)} bytes, fewer than seq_len + 1 = {seq_len + 1}; "
            "use more text, fewer shards or a shorter model.seq_len"
        )


def _windows(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather (x, y) int64 windows of seq_len tokens at the given starts, y shifted by one."""
    chunk = tokens[starts[:, None] + torch.arange(seq_len + 1)].long()
    return chunk[:, :-1], chunk[:, 1:]


class BatchStream:
    """Infinite, seed-deterministic stream of random (x, y) windows of one shard; resumable via state_dict."""

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int):
        if batch_size < 1 or seq_len < 1:
            raise DataError(f"batch_size={batch_size} and seq_len={seq_len} must be >= 1")
        _check_length(tokens, seq_len, "the training shard")
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        # A private generator: the stream must not depend on (or disturb) anyone else's use of the global RNG
        self.generator = torch.Generator().manual_seed(seed)
        self.batches = 0

    @property
    def tokens_per_batch(self) -> int:
        """Input tokens in one batch."""
        return self.batch_size * self.seq_len

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (x, y) pair, each int64 [batch_size, seq_len]."""
        high = len(self.tokens) - self.seq_len  # exclusive: the last window ends exactly at the shard's end
        starts = torch.randint(0, high, (self.batch_size,), generator=self.generator)
        self.batches += 1
        return _windows(self.tokens, starts, self.seq_len)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield batches forever."""
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Generator state and batch count, enough to resume the stream exactly."""
        return {"generator": self.generator.get_state(), "batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a state_dict() taken from a stream with the same tokens and shapes."""
        self.generator.set_state(state["generator"].clone())
        self.batches = int(state["batches"])


def eval_windows(eval_tokens: torch.Tensor, seq_len: int, batch_size: int, num_batches: int) -> list[Batch]:
    """A fixed, evenly spaced set of eval windows: the same every call and on every island."""
    _check_length(eval_tokens, seq_len, "the eval text")
    if batch_size < 1 or num_batches < 1:
        raise DataError(f"batch_size={batch_size} and num_batches={num_batches} must be >= 1")
    last_start = len(eval_tokens) - seq_len - 1
    starts = torch.linspace(0, last_start, batch_size * num_batches, dtype=torch.float64).long()
    return [_windows(eval_tokens, batch_starts, seq_len) for batch_starts in starts.split(batch_size)]


@torch.no_grad()
def evaluate_batches(
    model: nn.Module,
    batches: list[Batch],
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> float:
    """Mean loss over fixed batches of equal size (so the mean of means is the token mean)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        losses = []
        for x, y in batches:
            with autocast():
                _, loss = model(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
            losses.append(loss.item())
    finally:
        model.train(was_training)
    return sum(losses) / len(losses)


def evaluate(model: nn.Module, eval_tokens: torch.Tensor, seq_len: int, batch_size: int, num_batches: int) -> float:
    """Mean loss over a fixed, evenly spaced set of eval windows: the same every call and on every island."""
    return evaluate_batches(model, eval_windows(eval_tokens, seq_len, batch_size, num_batches))
