"""The list of known swarms (bootstrap/swarms.toml): join one by name instead of pasting addresses."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from p2p_diloco.config import tomllib
from p2p_diloco.errors import UserError


class SwarmListError(UserError, ValueError):
    """The swarm list is missing, malformed, or does not name the requested swarm."""


def swarms_file() -> Path:
    """$P2P_DILOCO_SWARMS, else ./bootstrap/swarms.toml, else the copy in the source tree."""
    if env := os.environ.get("P2P_DILOCO_SWARMS"):
        return Path(env)
    local = Path("bootstrap/swarms.toml")
    return local if local.is_file() else Path(__file__).resolve().parents[1] / "bootstrap" / "swarms.toml"


def load_swarms(path: Path | None = None) -> dict[str, dict[str, Any]]:
    """All swarms of the list, by name."""
    path = path or swarms_file()
    if not path.is_file():
        raise SwarmListError(f"swarm list {path} not found; set P2P_DILOCO_SWARMS or pass --initial-peers")
    try:
        return tomllib.loads(path.read_text()).get("swarms", {})
    except tomllib.TOMLDecodeError as error:
        raise SwarmListError(f"swarm list {path} is not valid TOML: {error}") from None


def resolve_swarm(name: str, path: Path | None = None) -> tuple[dict[str, Any], str | None]:
    """Config overrides (run id, initial peers) and the peer config file of a named swarm."""
    swarms = load_swarms(path)
    if name not in swarms:
        raise SwarmListError(f"unknown swarm {name!r}; known: {', '.join(sorted(swarms)) or 'none'}")
    entry = swarms[name]
    if not entry.get("initial_peers"):
        raise SwarmListError(f"swarm {name!r} lists no initial_peers")
    overrides = {"network.run_id": entry.get("run_id", name), "network.initial_peers": list(entry["initial_peers"])}
    return overrides, entry.get("config")
