"""`p2p-diloco eval`: eval loss and perplexity of an exported or pulled model on your data, and a greedy sample."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from p2p_diloco.errors import UserError


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The `eval` subcommand."""
    evaluate = commands.add_parser("eval", help="eval loss and perplexity of an exported or pulled model on your data")
    evaluate.add_argument(
        "--model", required=True, help="the --out of p2p-diloco export or pull (or any transformers model folder)"
    )
    evaluate.add_argument(
        "--data",
        help="text, JSONL, Parquet, a folder or a glob (default: the run's own data); "
        "its held-out split is what the islands' eval_loss measured",
    )
    evaluate.add_argument("--batches", type=int, help="eval batches (default: the run's eval_batches)")
    evaluate.add_argument(
        "--tokenizer", help="a tokenizer.json or folder (default: the model's own); must be the one it was trained with"
    )
    evaluate.add_argument("--prompt", help="also print a greedy continuation of this text")
    evaluate.add_argument("--max-new-tokens", type=int, default=40, help="length of the sample (default 40)")
    evaluate.add_argument("--json", action="store_true", help="print JSON")


def eval_config(folder: Path, spec: dict[str, Any] | None, args: argparse.Namespace) -> Any:
    """The run's data settings (or defaults for a foreign folder) with this command's --data/--batches/--tokenizer."""
    from p2p_diloco.config import load_config
    from p2p_diloco.train.model_files import spec_config

    given: dict[str, Any] = {}
    if args.data:
        given["data.path"] = args.data
    if args.batches is not None:
        given["data.eval_batches"] = args.batches
    own = spec is None or spec.get("tokenizer_files")
    if args.tokenizer or own:
        tokenizer = args.tokenizer or (str(folder) if (folder / "tokenizer_config.json").is_file() else None)
        if tokenizer is None:
            raise UserError(
                f"--model {folder} has no tokenizer files: pass --tokenizer PATH (the one it was trained with)"
            )
        given["data.tokenizer"] = tokenizer
    if spec is None:
        return load_config(None, {"model.kind": "hf", "model.config": str(folder), **given})
    return spec_config(spec, given)


def check_tokenizer(tokenizer: Any, spec: dict[str, Any] | None) -> None:
    """A tokenizer other than the one the model was trained with is a one-line error."""
    from p2p_diloco.train.model_files import vocabulary_digest

    expected = (spec or {}).get("tokenizer_vocabulary")
    if expected and vocabulary_digest(tokenizer) != expected:
        raise UserError(
            f"tokenizer {tokenizer.name} is not the one this model was trained with (vocabulary "
            f"{vocabulary_digest(tokenizer)}, the model's {expected}); leave --tokenizer out to use the model's own"
        )


@torch.no_grad()
def greedy(model: torch.nn.Module, tokenizer: Any, prompt: str, new_tokens: int, context: int) -> str | None:
    """A greedy continuation of `prompt` (None when the model gives no logits)."""
    ids = tokenizer.encode_batch([prompt])[0] or [tokenizer.eos_id]
    model.eval()
    for _ in range(new_tokens):
        logits, _ = model(torch.tensor([ids[-context:]]))
        if logits is None:
            return None
        ids.append(int(logits[0, -1].argmax()))
    return tokenizer.decode(ids)


def run(args: argparse.Namespace) -> int:
    """Evaluate; print the loss, perplexity and optional sample."""
    from p2p_diloco.island.trainer import check_vocabulary
    from p2p_diloco.train.data import evaluate_batches
    from p2p_diloco.train.model_files import read_model
    from p2p_diloco.train.sources import prepare_data
    from p2p_diloco.train.tokenizer import load_tokenizer

    try:
        folder = Path(args.model)
        model, spec = read_model(folder)
        config = eval_config(folder, spec, args)
        tokenizer = load_tokenizer(config.data.tokenizer, config.data.eos_token)
        check_tokenizer(tokenizer, spec)
        check_vocabulary(model, tokenizer, config)
        data = prepare_data(config, tokenizer)
        loss = evaluate_batches(model, data.eval_batches)
        sample = (
            greedy(model, tokenizer, args.prompt, args.max_new_tokens, config.model.seq_len) if args.prompt else None
        )
    except UserError as error:
        print(f"p2p-diloco eval: error: {error}", file=sys.stderr)
        return error.exit_code
    result = {
        "eval_loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "batches": len(data.eval_batches),
        "batch_size": config.train.batch_size,
        "seq_len": config.model.seq_len,
        "data": config.data.path,
        "sample": sample,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"eval loss {loss:.4f}, perplexity {result['perplexity']:.2f} ({result['batches']} batches of "
        f"{result['batch_size']} x {result['seq_len']} tokens of {config.data.path or 'the built-in corpus'})"
    )
    if args.prompt:
        print(sample if sample is not None else "(no sample: the model returns no logits)")
    return 0
