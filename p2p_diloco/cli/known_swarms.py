"""The list of known swarms (bootstrap/swarms.toml): join one by name instead of pasting addresses.

The list is, in this order: `--swarms-file PATH`, `$P2P_DILOCO_SWARMS`, `./bootstrap/swarms.toml`, the copy that
ships with p2p-diloco. An entry:

    [swarms.NAME]
    description = "what the swarm trains"
    run_id = "its run id"                      # default: NAME
    config = "peers/tiny.toml"                 # relative to the list's folder
    initial_peers = ["/ip4/.../tcp/.../p2p/..."]
    [swarms.NAME.network]                      # any [network] option, e.g. host_maddrs, relay, client_mode
    relay = "auto"
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from p2p_diloco.config import NetworkConfig, tomllib
from p2p_diloco.errors import UserError

ENV_VAR = "P2P_DILOCO_SWARMS"
ENTRY_KEYS = {"description", "run_id", "config", "initial_peers", "network"}


class SwarmListError(UserError, ValueError):
    """The swarm list is missing, malformed, or does not name the requested swarm."""


def swarms_file(explicit: str | os.PathLike | None = None) -> Path:
    """--swarms-file, else $P2P_DILOCO_SWARMS, else ./bootstrap/swarms.toml, else the copy that ships."""
    if explicit:
        return Path(explicit)
    if env := os.environ.get(ENV_VAR):
        return Path(env)
    from p2p_diloco.shipped import shipped_folder

    local = Path("bootstrap/swarms.toml")
    return local if local.is_file() else shipped_folder("bootstrap") / "swarms.toml"


def load_swarms(path: Path | None = None) -> dict[str, dict[str, Any]]:
    """All swarms of the list, by name."""
    path = path or swarms_file()
    if not path.is_file():
        raise SwarmListError(f"swarm list {path} not found; pass --swarms-file, set {ENV_VAR} or pass --initial-peers")
    try:
        swarms = tomllib.loads(path.read_text()).get("swarms", {})
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise SwarmListError(f"swarm list {path} is not valid TOML: {error}") from None
    if not isinstance(swarms, dict) or not all(isinstance(entry, dict) for entry in swarms.values()):
        raise SwarmListError(f"swarm list {path}: every [swarms.NAME] must be a table")
    return swarms


def resolve_swarm(name: str, path: Path | None = None) -> tuple[dict[str, Any], str | None]:
    """Config overrides (run id, initial peers, network options) and the peer config file of a named swarm."""
    path = path or swarms_file()
    swarms = load_swarms(path)
    if name not in swarms:
        raise SwarmListError(f"unknown swarm {name!r} in {path}; known: {', '.join(sorted(swarms)) or 'none'}")
    entry = swarms[name]
    where = f"swarm {name!r} in {path}"
    unknown = set(entry) - ENTRY_KEYS
    if unknown:
        raise SwarmListError(f"{where}: unknown keys {sorted(unknown)}; known: {', '.join(sorted(ENTRY_KEYS))}")
    if not entry.get("initial_peers"):
        raise SwarmListError(f"{where} lists no initial_peers")
    overrides: dict[str, Any] = {
        "network.run_id": entry.get("run_id", name),
        "network.initial_peers": list(entry["initial_peers"]),
    }
    network = entry.get("network", {})
    known = {field.name for field in dataclasses.fields(NetworkConfig)}
    if not isinstance(network, dict) or set(network) - known:
        raise SwarmListError(f"{where}: [network] options must be among {', '.join(sorted(known))}")
    overrides.update({f"network.{key}": value for key, value in network.items()})
    config = entry.get("config")
    if config is not None:
        resolved = (path.parent / config).resolve()
        if not resolved.is_file():
            raise SwarmListError(
                f"{where}: config {config} does not exist as {resolved} (paths in an entry are relative to the "
                "swarm list's folder)"
            )
        config = str(resolved)
    return overrides, config


def describe(path: Path) -> list[dict[str, Any]]:
    """One row per swarm of the list: name, run id, description, how many initial peers."""
    return [
        {
            "name": name,
            "run_id": entry.get("run_id", name),
            "description": entry.get("description", ""),
            "initial_peers": len(entry.get("initial_peers") or []),
        }
        for name, entry in sorted(load_swarms(path).items())
    ]
