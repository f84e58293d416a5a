"""Command-line flags for every field of the config tree, with each field's docstring as its help."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
from typing import Any

from p2p_diloco import config as config_module
from p2p_diloco.config import PeerConfig

FLAG_ALIASES = {
    "data.path": "data",
    "model.kind": "model-kind",
    "model.config": "model-config",
    "model.factory": "model-factory",
    "island.parallel": "island-parallel",
}
"""Config fields whose flag name differs from the field name."""


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


def config_fields() -> list[tuple[str, dataclasses.Field, str]]:
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


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field (e.g. --inner-steps for train.inner_steps)."""
    defaults = PeerConfig()
    for dotted, field, help_text in config_fields():
        flag = "--" + FLAG_ALIASES.get(dotted, dotted.split(".")[-1]).replace("_", "-")
        default = defaults
        for part in dotted.split("."):
            default = getattr(default, part)
        shown = " ".join(map(str, default)) if isinstance(default, list) else default
        help_text = f"{' '.join(help_text.split())} (default: {shown if shown not in ('', None) else 'none'})"
        kwargs: dict[str, Any] = {
            "dest": dotted,
            "default": None,
            "help": help_text.replace("%", "%%"),
            "metavar": dotted.split(".")[-1].upper(),
        }
        if str(field.type).startswith("list"):
            kwargs["nargs"] = "+"
        parser.add_argument(flag, **kwargs)


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields given on the command line, as dotted overrides."""
    return {dotted: getattr(args, dotted) for dotted, _, _ in config_fields() if getattr(args, dotted) is not None}
