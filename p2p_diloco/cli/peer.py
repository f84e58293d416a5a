"""`p2p-diloco peer`: start an island that trains with the swarm."""

from __future__ import annotations

import argparse
import signal
import sys

from p2p_diloco.cli.flags import add_config_flags, overrides
from p2p_diloco.cli.logs import setup_logging
from p2p_diloco.config import load_config
from p2p_diloco.errors import UserError


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The `peer` subcommand and its flags (one per config field)."""
    peer = commands.add_parser("peer", help="start an island that trains with the swarm")
    peer.add_argument("--config", help="TOML peer configuration, e.g. peers/tiny.toml")
    peer.add_argument("--swarm", help="join a swarm listed in bootstrap/swarms.toml by name")
    add_config_flags(peer)


def run(args: argparse.Namespace) -> int:
    """Validate the configuration, then train until the run's last outer step."""
    from p2p_diloco.cli.known_swarms import resolve_swarm
    from p2p_diloco.net.maddrs import validate_maddrs

    try:
        given, config_path = overrides(args), args.config
        if args.swarm:
            swarm_overrides, swarm_config = resolve_swarm(args.swarm)
            given, config_path = {**swarm_overrides, **given}, config_path or swarm_config
        config = load_config(config_path, given)
        if not config.network.initial_peers:
            print("p2p-diloco peer: no --initial-peers: starting a new swarm of one", file=sys.stderr)
        validate_maddrs(config.network.initial_peers, need_peer_id=True)
        validate_maddrs(config.network.host_maddrs + config.network.announce_maddrs, need_peer_id=False)
    except UserError as error:
        print(f"p2p-diloco peer: error: {error}", file=sys.stderr)
        return error.exit_code
    setup_logging(config.log_level)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from p2p_diloco.island.island import Island

    try:
        Island(config).run()
    except UserError as error:
        print(f"p2p-diloco peer: error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print("p2p-diloco peer: interrupted", file=sys.stderr)
        return 130
    return 0
