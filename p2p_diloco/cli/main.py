"""The `p2p-diloco` command: bootstrap, peer, swarm, status, swarms, dashboard, keys, pull, export, eval."""

from __future__ import annotations

import argparse
import sys

from p2p_diloco import __version__
from p2p_diloco.cli import bootstrap, dashboard, evaluate, export, keys, peer, pull, status, swarm
from p2p_diloco.errors import EXIT_BAD_INPUT, EXIT_NETWORK

__all__ = ["EXIT_BAD_INPUT", "EXIT_NETWORK", "build_parser", "main"]

COMMANDS = {
    "bootstrap": bootstrap,
    "peer": peer,
    "swarm": swarm,
    "status": status,
    "swarms": status,
    "dashboard": dashboard,
    "keys": keys,
    "pull": pull,
    "export": export,
    "eval": evaluate,
}
"""Each command's module: `add_parser(subparsers)` and `run(args) -> exit code`."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="p2p-diloco", description=__doc__)
    parser.add_argument("--version", action="version", version=f"p2p-diloco {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for module in dict.fromkeys(COMMANDS.values()):
        module.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `p2p-diloco` console script."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `peer --nproc-per-node` starts ranks with it
    return COMMANDS[args.command].run(args)


if __name__ == "__main__":
    raise SystemExit(main())
