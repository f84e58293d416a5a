"""A corpus of documents through Hugging Face `datasets`: text, JSON lines or Parquet files, folders and globs.

Local files only. `.txt`/`.md`/`.py`/`.rst` files are one document each; `.jsonl`/`.json` and `.parquet` files
hold one document per record, in `data.text_field`. Prepared corpora live in datasets' memory-mapped Arrow cache
(`data.cache_dir`); `data.streaming` reads them as a stream instead, for corpora larger than the disk can cache.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

from p2p_diloco.train.data import TEXT_SUFFIXES, DataError

BUILDERS = {
    **{suffix: "text" for suffix in TEXT_SUFFIXES},
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
}
"""File suffix -> the datasets builder that reads it."""


def corpus_files(path: str | None) -> tuple[str, list[str]]:
    """The datasets builder and the sorted files of data.path (a file, folder or glob; None: the built-in corpus)."""
    if path is None:
        folder = Path(os.__file__).parent
        return "text", sorted(str(p) for p in folder.glob("*.py") if p.is_file())
    source = Path(path).expanduser()
    if any(char in path for char in "*?["):
        files = sorted(p for p in map(Path, glob.glob(str(source), recursive=True)) if p.is_file())
        where = f"the glob {path}"
    elif source.is_dir():
        files = sorted((p for p in source.rglob("*") if p.is_file()), key=lambda p: p.relative_to(source).as_posix())
        where = f"the folder {path}"
    elif source.is_file():
        files, where = [source], path
    else:
        raise DataError(f"data.path {path} does not exist; point it at a file, a folder or a glob of them")
    known = [p for p in files if p.suffix.lower() in BUILDERS]
    if not known:
        raise DataError(f"{where} holds no {', '.join(BUILDERS)} files; point data.path at your corpus")
    builders = sorted({BUILDERS[p.suffix.lower()] for p in known})
    if len(builders) > 1:
        raise DataError(f"{where} mixes {' and '.join(builders)} files; point data.path at one kind")
    return builders[0], [str(p) for p in known]


def load_documents(path: str | None, *, text_field: str, streaming: bool, cache_dir: str | None) -> Any:
    """The corpus as a datasets Dataset (or IterableDataset when streaming) with the text in column `text_field`."""
    import datasets

    builder, files = corpus_files(path)
    options: dict[str, Any] = {"sample_by": "document"} if builder == "text" else {}
    where = f"data.path {path}" if path else "the built-in corpus"
    if all(os.path.getsize(file) == 0 for file in files):
        raise DataError(f"{where} holds no documents (its files are empty); add data or point data.path elsewhere")
    try:
        documents = datasets.load_dataset(
            builder, data_files=files, split="train", streaming=streaming, cache_dir=cache_dir, **options
        )
        if builder == "text":
            documents = documents.rename_column("text", text_field) if text_field != "text" else documents
        columns = _columns(documents)
    except (datasets.exceptions.DatasetGenerationError, UnicodeDecodeError, ValueError, StopIteration) as error:
        raise DataError(f"{where} cannot be read ({_cause(error)}); {_advice(builder)}") from None
    if text_field not in columns:
        raise DataError(
            f"{where} has no field {text_field!r} (it has {', '.join(columns) or 'no fields'}); "
            "set data.text_field to the field that holds the text"
        )
    if not streaming and len(documents) == 0:
        raise DataError(f"{where} holds no documents; add data or point data.path elsewhere")
    return documents


def _columns(documents: Any) -> list[str]:
    """Column names; a stream's are read off its first record (None when the stream is empty)."""
    if documents.column_names is not None:
        return list(documents.column_names)
    first = next(iter(documents.take(1)), None)
    if first is None:
        raise ValueError("the stream holds no documents")
    return list(first)


def _cause(error: BaseException) -> str:
    """The innermost error's one-line message: datasets wraps the parser's error in its own."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _advice(builder: str) -> str:
    return {
        "text": "text files must be UTF-8; convert or remove the others",
        "json": "each line of a .jsonl file must be one JSON object",
        "parquet": "give Parquet files written by pyarrow, pandas or datasets",
    }[builder]
