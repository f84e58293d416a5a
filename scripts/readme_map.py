"""Regenerate the README's layout map (one table per layer) from the module docstrings: `make readme-map`."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

LAYERS = [
    ("top", "the package and what every layer shares"),
    ("diloco", "the math, pure torch (no hivemind)"),
    ("train", "what an island trains and writes"),
    ("net", "the network layer, on hivemind"),
    ("island", "one island, composing the layers below"),
    ("cli", "the commands and the one local-swarm launcher"),
]
START, END = "**p2p_diloco/** — ", "## How it works"


def layout_map(root: Path) -> str:
    """The map's markdown: each module with the first paragraph of its docstring."""
    rows: dict[str, list[tuple[str, str]]] = {layer: [] for layer, _ in LAYERS}
    for path in sorted((root / "p2p_diloco").rglob("*.py")):
        if path.name == "__main__.py" or "__pycache__" in path.parts:
            continue
        relative = path.relative_to(root).as_posix()
        parts = relative.split("/")
        doc = (ast.get_docstring(ast.parse(path.read_text())) or "").split("\n\n")[0].replace("\n", " ")
        rows[parts[1] if len(parts) > 2 else "top"].append((relative, doc))
    out = []
    for layer, title in LAYERS:
        out += [f"**{layer if layer != 'top' else 'p2p_diloco/'}** — {title}", "", "| module | what it does |"]
        out += ["|---|---|", *(f"| `{relative}` | {doc} |" for relative, doc in rows[layer]), ""]
    return "\n".join(out) + "\n"


def with_map(readme: str, root: Path) -> str:
    """The README text with its map replaced by the current one."""
    start, end = readme.index(START), readme.index(END)
    return readme[:start] + layout_map(root) + readme[end:]


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
    readme = root / "README.md"
    readme.write_text(with_map(readme.read_text(), root))
    print(f"updated the layout map in {readme}")
