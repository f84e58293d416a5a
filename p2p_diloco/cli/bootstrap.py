"""`p2p-diloco bootstrap`: run a DHT node that trains nothing and lets peers meet."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from p2p_diloco.cli.logs import setup_logging
from p2p_diloco.config import LISTEN_EVERYWHERE, ConfigError, tomllib
from p2p_diloco.errors import UserError

BOOTSTRAP_DEFAULTS = {
    "identity": None,
    "host_maddrs": list(LISTEN_EVERYWHERE),
    "announce_maddrs": [],
    "initial_peers": [],
    "maddrs_file": None,
    "run_id": "p2p-diloco",
    "relay": True,
    "relay_port": 0,
    "relay_max_islands": 64,
    "peers_file": None,
    "swarm_public_key": None,
    "membership": None,
}
"""Settings of a bootstrap, overridden by its --config file, then by flags."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The `bootstrap` subcommand and its flags."""
    bootstrap = commands.add_parser("bootstrap", help="run a DHT node that trains nothing and lets peers meet")
    bootstrap.add_argument("--config", help="TOML bootstrap configuration, e.g. bootstrap/bootstrap.toml")
    bootstrap.add_argument("--identity", help="key file for a stable peer id (created if missing)")
    bootstrap.add_argument("--host-maddrs", nargs="+", help=f"listen addresses (default {' '.join(LISTEN_EVERYWHERE)})")
    bootstrap.add_argument("--announce-maddrs", nargs="+", help="addresses peers should dial")
    bootstrap.add_argument("--initial-peers", nargs="+", help="other bootstraps or live peers")
    bootstrap.add_argument("--maddrs-file", help="also write the multiaddrs here, one per line, once reachable")
    bootstrap.add_argument("--run-id", help="run id shown in the printed peer command (default p2p-diloco)")
    bootstrap.add_argument(
        "--relay",
        type=lambda text: text.lower() in ("1", "true", "yes", "on"),
        metavar="true|false",
        help="relay for islands that nothing can dial, e.g. behind NATs (default true)",
    )
    bootstrap.add_argument("--relay-port", type=int, help="TCP port of the relay's control connection (default: any)")
    bootstrap.add_argument("--relay-max-islands", type=int, help="islands relayed at once (default 64)")
    bootstrap.add_argument(
        "--peers-file", help="keep the multiaddrs of live islands here and rejoin through them after a restart"
    )
    bootstrap.add_argument("--swarm-public-key", help="a private swarm's owner public key (ed25519:...)")
    bootstrap.add_argument("--membership", help="this bootstrap's membership token (for its --identity)")
    bootstrap.add_argument("--join-timeout", type=float, default=30.0, help="seconds to reach --initial-peers")
    bootstrap.add_argument("--log-level", default="INFO")


def bootstrap_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Defaults, then the --config file, then flags."""
    settings = dict(BOOTSTRAP_DEFAULTS)
    if args.config:
        try:
            with open(args.config) as handle:
                values = tomllib.loads(handle.read())
        except (OSError, tomllib.TOMLDecodeError) as error:
            raise ConfigError(f"bootstrap config {args.config}: {error}") from None
        unknown = set(values) - set(settings)
        if unknown:
            raise ConfigError(f"bootstrap config {args.config}: unknown keys {sorted(unknown)}")
        settings.update(values)
    settings.update({key: getattr(args, key) for key in settings if getattr(args, key) is not None})
    return settings


def run(args: argparse.Namespace) -> int:
    """Validate the settings, then serve the DHT until SIGINT or SIGTERM."""
    from p2p_diloco.net.bootstrap import run_bootstrap
    from p2p_diloco.net.maddrs import validate_maddrs

    try:
        settings = bootstrap_settings(args)
        validate_maddrs(settings["initial_peers"], need_peer_id=True)
        validate_maddrs(settings["host_maddrs"] + settings["announce_maddrs"], need_peer_id=False)
        setup_logging(args.log_level)
        run_bootstrap(**settings, timeout=args.join_timeout)
    except UserError as error:
        print(f"p2p-diloco bootstrap: error: {error}", file=sys.stderr)
        return error.exit_code
    return 0
