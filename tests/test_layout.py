"""The package's layout holds: layers import downwards only, no cycles, small modules and functions, a map."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "p2p_diloco"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60

# What each layer may import from the project (besides itself and the top-level helper modules).
LAYERS = {
    "diloco": set(),
    "train": {"diloco"},
    "net": {"diloco"},
    "island": {"diloco", "train", "net"},
    "cli": {"diloco", "train", "net", "island"},
}
TOP_LEVEL = {"config", "errors", "files", "process", "signals", "timeouts", "validation"}
"""Modules at the top of the package that every layer may use; they import no layer but `diloco`."""


def _modules() -> dict[str, Path]:
    return {
        ".".join(path.relative_to(REPO).with_suffix("").parts): path
        for path in sorted(PACKAGE.rglob("*.py"))
        if "__pycache__" not in path.parts
    }


def _imports(path: Path, *, typing_only: bool = True) -> set[str]:
    """Every module name imported anywhere in the file (function-level imports included; with `typing_only`
    False, not those under `if TYPE_CHECKING:`, which never run)."""
    tree = ast.parse(path.read_text())
    if not typing_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
                node.body = []
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else None


def test_layers_import_only_downwards() -> None:
    modules = _modules()
    for module, path in modules.items():
        own = _layer(module)
        top = module.split(".")[1] if module.count(".") == 1 else None
        for name in _imports(path):
            if not name.startswith("p2p_diloco.") or name not in modules and name.rsplit(".", 1)[0] not in modules:
                continue
            target = name if name in modules else name.rsplit(".", 1)[0]
            layer = _layer(target)
            if own is not None and layer is not None and layer != own:
                assert layer in LAYERS[own], f"{module} (layer {own}) imports {target} (layer {layer})"
            if top in TOP_LEVEL and layer is not None:
                assert layer == "diloco", f"top-level helper {module} imports {target} (layer {layer})"


def test_the_math_imports_no_networking() -> None:
    for module, path in _modules().items():
        if _layer(module) == "diloco":
            hivemind = [name for name in _imports(path) if name.split(".")[0] in ("hivemind", "multiaddr")]
            assert not hivemind, f"{module} imports {hivemind}"


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {
        module: {name if name in modules else name.rsplit(".", 1)[0] for name in _imports(path, typing_only=False)}
        & set(modules)
        for module, path in modules.items()
    }
    for module in graph:
        graph[module].discard(module)
    state: dict[str, int] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                pytest.fail("import cycle: " + " -> ".join(trail[trail.index(target) :] + [target]))
            if target not in state:
                visit(target, trail + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_modules_and_functions_stay_small() -> None:
    for module, path in _modules().items():
        source = path.read_text()
        assert source.count("\n") <= MAX_MODULE_LINES, f"{module} has {source.count(chr(10))} lines"
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                assert length <= MAX_FUNCTION_LINES, f"{module}.{node.name} is {length} lines long"


def test_every_module_has_a_docstring_and_a_place_in_the_readme_map() -> None:
    readme = (REPO / "README.md").read_text()
    for module, path in _modules().items():
        tree = ast.parse(path.read_text())
        assert ast.get_docstring(tree), f"{module} has no module docstring"
        relative = path.relative_to(REPO).as_posix()
        if path.name != "__main__.py":
            assert f"`{relative}`" in readme, f"README.md's layout map does not list {relative}"


def test_public_api_resolves() -> None:
    import p2p_diloco

    for name in p2p_diloco.__all__:
        assert getattr(p2p_diloco, name) is not None, name


def test_the_readme_map_is_current() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("readme_map", REPO / "scripts" / "readme_map.py")
    readme_map = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(readme_map)
    readme = (REPO / "README.md").read_text()
    assert readme_map.with_map(readme, REPO) == readme, "the README's layout map is stale: run make readme-map"
