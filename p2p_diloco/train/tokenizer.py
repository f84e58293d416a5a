"""Tokenizers from local files only: bytes, a `tokenizers` tokenizer.json, or a transformers tokenizer folder.

Each gives token ids for a batch of documents, its vocabulary size, the end-of-text id put between documents, and
a fingerprint of its vocabulary and rules, so that islands of one run provably cut text the same way.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from p2p_diloco.errors import UserError

END_OF_TEXT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
"""End-of-text tokens looked for, in order, when a tokenizer does not name one."""


class TokenizerError(UserError, ValueError):
    """A tokenizer the user must fix or point elsewhere; the message says what."""


class Tokenizer:
    """What the data pipeline needs of a tokenizer."""

    name: str
    vocab_size: int
    eos_id: int
    fingerprint: str
    """'bytes', or a short hash of the tokenizer's full serialization."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens."""
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        """The text of token ids."""
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """One token per UTF-8 byte; NUL (which text never holds) separates documents."""

    name, vocab_size, eos_id, fingerprint = "bytes", 256, 0, "bytes"

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """UTF-8 bytes of each text."""
        return [list(text.encode("utf-8")) for text in texts]

    def decode(self, ids: list[int]) -> str:
        """UTF-8 text of the bytes (invalid sequences replaced)."""
        return bytes(i for i in ids if 0 < i < 256).decode("utf-8", errors="replace")


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _eos(vocab: dict[str, int], declared: str | None, wanted: str | None, where: str) -> int:
    for name in [wanted] if wanted else [declared, *END_OF_TEXT_NAMES]:
        if name is not None and name in vocab:
            return vocab[name]
    if wanted:
        raise TokenizerError(f"{where} has no token {wanted!r} (data.eos_token); name one of its special tokens")
    raise TokenizerError(
        f"{where} names no end-of-text token and has none of {', '.join(END_OF_TEXT_NAMES)}; "
        "set data.eos_token to the token that separates documents"
    )


class FileTokenizer(Tokenizer):
    """A `tokenizers` tokenizer.json."""

    def __init__(self, path: Path, eos_token: str | None):
        from tokenizers import Tokenizer as RustTokenizer

        try:
            self.backend = RustTokenizer.from_file(str(path))
        except Exception as error:  # the library raises a bare Exception for a malformed file
            raise TokenizerError(f"tokenizer file {path} cannot be read ({error}); give a tokenizer.json") from None
        self.name = str(path)
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        self.eos_id = _eos(self.backend.get_vocab(with_added_tokens=True), None, eos_token, f"tokenizer {path}")
        self.fingerprint = _digest(self.backend.to_str())

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text (the Rust tokenizer encodes the batch in parallel)."""
        return [encoding.ids for encoding in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        """Text of ids."""
        return self.backend.decode(ids)


class PretrainedTokenizer(Tokenizer):
    """A transformers tokenizer folder (tokenizer.json, tokenizer_config.json, ...), local files only."""

    def __init__(self, path: Path, eos_token: str | None):
        from transformers import AutoTokenizer

        try:
            self.backend = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise TokenizerError(f"tokenizer folder {path} cannot be loaded ({first})") from None
        self.name = str(path)
        self.vocab_size = len(self.backend)
        vocab = self.backend.get_vocab()
        self.eos_id = _eos(vocab, self.backend.eos_token, eos_token, f"tokenizer {path}")
        serial = self.backend.backend_tokenizer.to_str() if self.backend.is_fast else json.dumps(sorted(vocab.items()))
        self.fingerprint = _digest(serial)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text, without the tokenizer's own special tokens."""
        return self.backend(texts, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        """Text of ids."""
        return self.backend.decode(ids)


def load_tokenizer(spec: str, eos_token: str | None = None) -> Tokenizer:
    """The tokenizer for data.tokenizer: 'bytes', a tokenizer.json file or a local tokenizer folder."""
    if spec == "bytes":
        if eos_token is not None:
            raise TokenizerError("data.eos_token needs a tokenizer; the bytes tokenizer separates documents with NUL")
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_file():
        return FileTokenizer(path, eos_token)
    if path.is_dir():
        return PretrainedTokenizer(path, eos_token)
    raise TokenizerError(
        f"data.tokenizer {spec} does not exist; give 'bytes', a tokenizer.json file or a local tokenizer folder"
    )
