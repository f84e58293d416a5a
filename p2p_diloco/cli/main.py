"""The `p2p-diloco` command: bootstrap, peer and swarm. It only parses configuration and starts things."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import logging
import signal
import sys
from typing import Any

from p2p_diloco import config as config_module
from p2p_diloco.config import ConfigError, PeerConfig, load_config

EXIT_BAD_INPUT = 2
EXIT_NETWORK = 3

# Config fields whose flag name differs from the field name.
FLAG_ALIASES = {"data.path": "data"}


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a config dataclass (the string literal right after each field)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr):
            if isinstance(following.value, ast.Constant) and isinstance(following.value.value, str):
                docs[node.target.id] = following.value.value
    return docs


def _config_fields() -> list[tuple[str, dataclasses.Field, str]]:
    """(dotted name, field, help) of every leaf field of PeerConfig."""
    leaves = []
    top_docs = _field_docs(PeerConfig)
    for field in dataclasses.fields(PeerConfig):
        if field.name in config_module.SECTIONS:
            section_cls = type(getattr(PeerConfig(), field.name))
            docs = _field_docs(section_cls)
            for leaf in dataclasses.fields(section_cls):
                leaves.append((f"{field.name}.{leaf.name}", leaf, docs.get(leaf.name, "")))
        else:
            leaves.append((field.name, field, top_docs.get(field.name, "")))
    return leaves


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    for dotted, field, help_text in _config_fields():
        flag = "--" + FLAG_ALIASES.get(dotted, dotted.split(".")[-1]).replace("_", "-")
        kwargs: dict[str, Any] = {"dest": dotted, "default": None, "help": help_text}
        if str(field.type).startswith("list"):
            kwargs["nargs"] = "+"
        parser.add_argument(flag, **kwargs)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {dotted: getattr(args, dotted) for dotted, _, _ in _config_fields() if getattr(args, dotted) is not None}


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with its three subcommands."""
    parser = argparse.ArgumentParser(prog="p2p-diloco", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    bootstrap = commands.add_parser("bootstrap", help="run a DHT node that trains nothing and lets peers meet")
    bootstrap.add_argument("--config", help="TOML bootstrap configuration, e.g. bootstrap/bootstrap.toml")
    bootstrap.add_argument("--identity", help="key file for a stable peer id (created if missing)")
    bootstrap.add_argument("--host-maddrs", nargs="+", help="listen addresses (default /ip4/127.0.0.1/tcp/0)")
    bootstrap.add_argument("--announce-maddrs", nargs="+", help="addresses peers should dial")
    bootstrap.add_argument("--initial-peers", nargs="+", help="other bootstraps or live peers")
    bootstrap.add_argument("--maddrs-file", help="also write the multiaddrs here, one per line, once reachable")
    bootstrap.add_argument("--run-id", help="run id shown in the printed peer command")
    bootstrap.add_argument("--join-timeout", type=float, default=30.0, help="seconds to reach --initial-peers")
    bootstrap.add_argument("--log-level", default="INFO")

    peer = commands.add_parser("peer", help="start an island that trains with the swarm")
    peer.add_argument("--config", help="TOML peer configuration, e.g. peers/tiny.toml")
    peer.add_argument("--swarm", help="join a swarm listed in bootstrap/swarms.toml by name")
    _add_config_flags(peer)

    swarm = commands.add_parser("swarm", help="run a local swarm: a bootstrap and N islands on 127.0.0.1")
    swarm.add_argument("--peers", type=int, default=3, help="number of islands")
    swarm.add_argument("--config", help="TOML peer configuration shared by the islands")
    swarm.add_argument("--outer-steps", type=int, help="outer steps to run")
    swarm.add_argument("--inner-steps", type=int, help="inner steps per outer step")
    swarm.add_argument("--out", default="runs/swarm", help="folder for metrics, logs and the loss plot")
    swarm.add_argument("--baseline", action="store_true", help="also train one island alone, for comparison")
    swarm.add_argument("peer_args", nargs=argparse.REMAINDER, help="extra flags passed to every peer after --")
    return parser


def _run_peer(args: argparse.Namespace) -> int:
    from p2p_diloco.cli.known_swarms import SwarmListError, resolve_swarm
    from p2p_diloco.island.island import Island
    from p2p_diloco.net.dht import JoinError, ModelMismatchError
    from p2p_diloco.net.maddrs import MultiaddrError, validate_maddrs
    from p2p_diloco.train.checkpoint import CheckpointError
    from p2p_diloco.train.data import DataError

    try:
        overrides, config_path = _overrides(args), args.config
        if args.swarm:
            swarm_overrides, swarm_config = resolve_swarm(args.swarm)
            overrides, config_path = {**swarm_overrides, **overrides}, config_path or swarm_config
        config = load_config(config_path, overrides)
        if not config.network.initial_peers:
            print("p2p-diloco peer: no --initial-peers: starting a new swarm of one", file=sys.stderr)
        validate_maddrs(config.network.initial_peers, need_peer_id=True)
        validate_maddrs(config.network.host_maddrs + config.network.announce_maddrs, need_peer_id=False)
    except (ConfigError, MultiaddrError, SwarmListError) as error:
        print(f"p2p-diloco peer: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    _setup_logging(config.log_level)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        Island(config).run()
    except (DataError, CheckpointError, ModelMismatchError) as error:
        print(f"p2p-diloco peer: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except JoinError as error:
        print(f"p2p-diloco peer: error: {error}", file=sys.stderr)
        return EXIT_NETWORK
    except KeyboardInterrupt:
        print("p2p-diloco peer: interrupted", file=sys.stderr)
        return 130
    return 0


BOOTSTRAP_DEFAULTS = {
    "identity": None,
    "host_maddrs": ["/ip4/127.0.0.1/tcp/0"],
    "announce_maddrs": [],
    "initial_peers": [],
    "maddrs_file": None,
    "run_id": "p2p-diloco",
}


def _bootstrap_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Defaults, then the --config file, then flags."""
    settings = dict(BOOTSTRAP_DEFAULTS)
    if args.config:
        try:
            values = config_module.tomllib.loads(open(args.config).read())
        except (OSError, config_module.tomllib.TOMLDecodeError) as error:
            raise ConfigError(f"bootstrap config {args.config}: {error}") from None
        unknown = set(values) - set(settings)
        if unknown:
            raise ConfigError(f"bootstrap config {args.config}: unknown keys {sorted(unknown)}")
        settings.update(values)
    settings.update({key: getattr(args, key) for key in settings if getattr(args, key) is not None})
    return settings


def _run_bootstrap(args: argparse.Namespace) -> int:
    from p2p_diloco.cli.bootstrap import run_bootstrap
    from p2p_diloco.net.dht import JoinError
    from p2p_diloco.net.maddrs import MultiaddrError, validate_maddrs

    try:
        settings = _bootstrap_settings(args)
        validate_maddrs(settings["initial_peers"], need_peer_id=True)
        validate_maddrs(settings["host_maddrs"] + settings["announce_maddrs"], need_peer_id=False)
    except (ConfigError, MultiaddrError) as error:
        print(f"p2p-diloco bootstrap: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    _setup_logging(args.log_level)
    try:
        run_bootstrap(**settings, timeout=args.join_timeout)
    except JoinError as error:
        print(f"p2p-diloco bootstrap: error: {error}", file=sys.stderr)
        return EXIT_NETWORK
    return 0


def _run_swarm(args: argparse.Namespace) -> int:
    from p2p_diloco.cli.swarm import run_local_swarm

    # Ctrl-C must stop the swarm even when a shell started us with SIGINT ignored (a background job).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    extra = [arg for arg in args.peer_args if arg != "--"]
    return run_local_swarm(
        peers=args.peers,
        config=args.config,
        outer_steps=args.outer_steps,
        inner_steps=args.inner_steps,
        out=args.out,
        baseline=args.baseline,
        extra_peer_args=extra,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `p2p-diloco` console script."""
    args = build_parser().parse_args(argv)
    handlers = {"bootstrap": _run_bootstrap, "peer": _run_peer, "swarm": _run_swarm}
    return handlers[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
