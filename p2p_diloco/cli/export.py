"""`p2p-diloco export`: an island's (or a pull's) checkpoint as a model others load without p2p-diloco."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from p2p_diloco.errors import UserError
from p2p_diloco.train.model_files import FORMATS


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The `export` subcommand."""
    export = commands.add_parser("export", help="write a checkpoint's model as a transformers folder or safetensors")
    export.add_argument(
        "--checkpoint-dir",
        required=True,
        help="an island's --checkpoint-dir, or OUT/checkpoint of a pull; its newest intact checkpoint is exported",
    )
    export.add_argument("--out", required=True, help="folder to write the model to (created if missing)")
    export.add_argument(
        "--format",
        choices=FORMATS,
        help="hf (from_pretrained folder; the default for transformers "
        "models), safetensors (the default otherwise) or torch (a state_dict)",
    )
    export.add_argument("--tokenizer", help="where the run's tokenizer is on this machine, if not where it was trained")
    export.add_argument("--config", help="the run's peer config, for checkpoints older than this version")


def checkpoint_model(directory: str, config_path: str | None, tokenizer: str | None) -> tuple[Any, dict, dict]:
    """The model of the newest intact checkpoint in `directory`, its spec and where its weights came from."""
    from p2p_diloco.config import load_config
    from p2p_diloco.shipped import config_path as preset
    from p2p_diloco.train.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, unusable_checkpoints
    from p2p_diloco.train.model_files import describe, load_flat, model_from_spec

    if not Path(directory).is_dir():
        raise CheckpointError(f"--checkpoint-dir {directory} is not a folder")
    path = latest_checkpoint(directory)
    if path is None and (corrupt := unusable_checkpoints(directory)):
        names = ", ".join(item.name for item in corrupt)
        raise CheckpointError(f"every checkpoint in {directory} is corrupt ({names}): nothing to export")
    if path is None:
        raise CheckpointError(f"--checkpoint-dir {directory} holds no checkpoint (ckpt-*.pt with its .sha256)")
    checkpoint = load_checkpoint(path)
    spec = checkpoint.get("model_spec")
    if config_path:
        spec = describe(load_config(preset(config_path)))
    if not isinstance(spec, dict) or "model" not in spec:
        raise CheckpointError(f"checkpoint {path} does not say which model it holds: pass --config (the run's)")
    if tokenizer:
        spec["data"]["tokenizer"] = str(Path(tokenizer).resolve())
    anchor = checkpoint.get("anchor")
    if not hasattr(anchor, "numel"):
        raise CheckpointError(f"checkpoint {path} holds no anchor weights; is it a p2p-diloco checkpoint?")
    model = model_from_spec(spec)
    load_flat(model, anchor)
    origin = {
        "run_id": checkpoint.get("run_id"),
        "outer_step": checkpoint.get("outer_step"),
        "source": f"checkpoint {path}",
    }
    return model, spec, origin


def run(args: argparse.Namespace) -> int:
    """Export the newest intact checkpoint; exit 2 with one line when it cannot be."""
    from p2p_diloco.train.model_files import default_format, write_model

    try:
        model, spec, origin = checkpoint_model(args.checkpoint_dir, args.config, args.tokenizer)
        fmt = args.format or default_format(spec)
        out = write_model(model, spec, Path(args.out), fmt, origin)
    except UserError as error:
        print(f"p2p-diloco export: error: {error}", file=sys.stderr)
        return error.exit_code
    print(f"exported outer step {origin['outer_step']} of run {origin['run_id']!r} as {fmt} into {out}")
    return 0
