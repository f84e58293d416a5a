"""`p2p-diloco pull`: download the swarm's current model without training, and write it out."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from p2p_diloco.cli.logs import setup_logging
from p2p_diloco.errors import UserError
from p2p_diloco.train.model_files import FORMATS

STATE_FOLDER = "checkpoint"
"""Where, inside --out, pull also keeps the raw outer state (for `p2p-diloco export --checkpoint-dir`)."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The `pull` subcommand: the peer flags (which run, which model) plus --out and --format."""
    from p2p_diloco.cli.peer import add_peer_flags

    pull = commands.add_parser(
        "pull", help="download the swarm's current model (verified like a newcomer's state) without training"
    )
    pull.add_argument("--out", required=True, help="folder to write the model to (created if missing)")
    pull.add_argument(
        "--format",
        choices=FORMATS,
        help="hf (transformers models, the default for them), safetensors (the default otherwise) or torch",
    )
    add_peer_flags(pull)


def run(args: argparse.Namespace) -> int:
    """Join as a client, download and verify the state, write the model and its state; exit 0."""
    from p2p_diloco.cli.peer import peer_config
    from p2p_diloco.island.pull import pull
    from p2p_diloco.train.checkpoint import save_checkpoint
    from p2p_diloco.train.model_files import default_format, describe, load_flat, write_model

    try:
        config = peer_config(args)
        if not config.network.initial_peers:
            raise UserError("pass --initial-peers MADDR (a bootstrap or live island of the run) or --swarm NAME")
        setup_logging(config.log_level)
        pulled = pull(config)
        state, spec, out = pulled.state, describe(config), Path(args.out)
        load_flat(pulled.model, state.anchor)
        origin = {
            "run_id": config.network.run_id,
            "outer_step": state.outer_step,
            "digest": state.digest(),
            "source": f"pulled from a swarm of {pulled.islands} islands",
        }
        write_model(pulled.model, spec, out, args.format or default_format(spec), origin)
        save_checkpoint(
            out / STATE_FOLDER, {**state.checkpoint(), "model_spec": spec, "run_id": origin["run_id"]}, state.outer_step
        )
    except UserError as error:
        print(f"p2p-diloco pull: error: {error}", file=sys.stderr)
        return error.exit_code
    print(f"pulled run {origin['run_id']!r} at outer step {state.outer_step} (anchor {origin['digest']}) into {out}")
    return 0
