"""`p2p-diloco peer`: start an island that trains with the swarm."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from p2p_diloco.cli.flags import add_config_flags, overrides
from p2p_diloco.cli.logs import setup_logging
from p2p_diloco.config import PeerConfig, load_config
from p2p_diloco.errors import UserError
from p2p_diloco.signals import GracefulStop, Stopped


def add_peer_flags(parser: argparse.ArgumentParser) -> None:
    """--config, --swarm, --swarms-file and one flag per config field: what says which run and model."""
    parser.add_argument(
        "--config", help="TOML peer configuration, e.g. peers/tiny.toml, or a shipped preset's name: tiny, tiny-llama"
    )
    parser.add_argument("--swarm", help="join a swarm of the list of known swarms by name")
    parser.add_argument(
        "--swarms-file",
        help="the list of known swarms (default: $P2P_DILOCO_SWARMS, then ./bootstrap/swarms.toml, then the list "
        "that ships with p2p-diloco)",
    )
    add_config_flags(parser)


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The `peer` subcommand and its flags (one per config field)."""
    add_peer_flags(commands.add_parser("peer", help="start an island that trains with the swarm"))


def peer_config(args: argparse.Namespace) -> PeerConfig:
    """The PeerConfig of --config (a file or a preset), --swarm and the flags; addresses validated."""
    from p2p_diloco.cli.known_swarms import resolve_swarm, swarms_file
    from p2p_diloco.net.maddrs import validate_maddrs
    from p2p_diloco.shipped import config_path

    given, path = overrides(args), args.config and config_path(args.config)
    if args.swarm:
        swarm_overrides, swarm_config = resolve_swarm(args.swarm, swarms_file(args.swarms_file))
        given, path = {**swarm_overrides, **given}, path or swarm_config
    config = load_config(path, given)
    validate_maddrs(config.network.initial_peers, need_peer_id=True)
    validate_maddrs(config.network.host_maddrs + config.network.announce_maddrs, need_peer_id=False)
    return config


def run(args: argparse.Namespace) -> int:
    """Validate the configuration, then train until the run's last outer step."""
    try:
        config = peer_config(args)
        if not config.network.initial_peers and not config.network.solo and os.environ.get("RANK", "0") == "0":
            print("p2p-diloco peer: no --initial-peers: starting a new swarm of one", file=sys.stderr)
    except UserError as error:
        print(f"p2p-diloco peer: error: {error}", file=sys.stderr)
        return error.exit_code
    from p2p_diloco.cli.launch import launch_island, wants_ranks
    from p2p_diloco.island.ranks import launched_as_rank

    if wants_ranks(config.island) and not launched_as_rank():
        try:
            with owned_checkpoint_folder(config, ranks=True):
                return launch_island(config, args.argv)
        except UserError as error:
            print(f"p2p-diloco peer: error: {error}", file=sys.stderr)
            return error.exit_code
    setup_logging(config.log_level)
    stop = GracefulStop("p2p-diloco peer").install()
    try:
        if launched_as_rank():
            from p2p_diloco.island.ranked import run_ranked_island

            return run_ranked_island(config, stop)
        from p2p_diloco.island.island import Island
        from p2p_diloco.island.link import begin_join
        from p2p_diloco.quick_start import plain_start

        with owned_checkpoint_folder(config) as (trainer, took_over):
            # The DHT process starts p2pd and reaches the swarm while this one builds the model and loads data.
            joining = None if config.network.solo or plain_start() else begin_join(config.network)
            try:
                Island(config, stop=stop, joining=joining, trainer=trainer, took_over=took_over).run()
            finally:
                if joining is not None:
                    joining.abandon()
    except UserError as error:
        print(f"p2p-diloco peer: error: {error}", file=sys.stderr)
        return error.exit_code
    except Stopped as stopped:
        print(f"p2p-diloco peer: stopped by {stopped} before training started", file=sys.stderr)
        return stopped.exit_code
    stop.report_checkpoint_kept()
    return stop.exit_code


@contextmanager
def owned_checkpoint_folder(config: PeerConfig, ranks: bool = False) -> Iterator[tuple[Any, float | None]]:
    """Hold --checkpoint-dir while the island runs, or refuse; a standby builds its model and loads its data first,
    then waits for the folder. Yields the standby's trainer (a ranked island's: None) and takeover time."""
    from p2p_diloco.island.ownership import CheckpointFolderLock

    if config.standby and not config.checkpoint_dir:
        raise UserError("--standby true takes over an island's --checkpoint-dir: pass the folder that island uses")
    if not config.checkpoint_dir or (ranks and config.island.nnodes != "1"):  # several nodes may share one folder
        yield None, None
        return
    lock = CheckpointFolderLock(config.checkpoint_dir)
    try:
        if not config.standby:
            lock.acquire_or_refuse()
            yield None, None
            return
        trainer = None
        if not ranks:  # a ranked island's ranks build their models after the takeover: its launcher waits cold
            from p2p_diloco.island.idle_priority import idle_priority

            with idle_priority("standby warming up (imports, model, data)"):
                import torch

                from p2p_diloco.island.trainer import LocalTrainer

                torch.set_num_threads(config.train.threads)
                trainer = LocalTrainer(config)
        lock.wait()
        yield trainer, time.monotonic()
    finally:
        lock.release()
