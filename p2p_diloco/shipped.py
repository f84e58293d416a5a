"""The ready-to-run files that ship with p2p-diloco: peer presets (`peers/`) and the list of known swarms.

In a source checkout they are the repository's `peers/` and `bootstrap/` folders; an installed wheel carries the
same files as `p2p_diloco._shipped.peers` and `p2p_diloco._shipped.bootstrap` (see pyproject.toml).
"""

from __future__ import annotations

from pathlib import Path

from p2p_diloco.errors import UserError


class PresetError(UserError, ValueError):
    """A --config that is neither a file nor the name of a shipped preset."""


def shipped_folder(name: str) -> Path:
    """The shipped `peers` or `bootstrap` folder: the checkout's own, else the installed package's copy."""
    checkout = Path(__file__).resolve().parents[1] / name
    if (Path(__file__).resolve().parents[1] / "pyproject.toml").is_file() and checkout.is_dir():
        return checkout
    return Path(__file__).resolve().parent / "_shipped" / name


def presets() -> list[str]:
    """Names of the shipped peer presets (`tiny`, `tiny-llama`, ...)."""
    return sorted(path.stem for path in shipped_folder("peers").glob("*.toml"))


def config_path(value: str) -> str:
    """--config as given when it is a file, else the shipped preset of that name (`tiny` -> peers/tiny.toml)."""
    if Path(value).expanduser().is_file() or "/" in value or value.endswith(".toml"):
        return value
    preset = shipped_folder("peers") / f"{value}.toml"
    if preset.is_file():
        return str(preset)
    raise PresetError(
        f"--config {value}: no such file and no shipped preset of that name; presets: {', '.join(presets())}"
    )
