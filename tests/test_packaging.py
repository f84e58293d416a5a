"""The wheel: it builds, installs into a fresh venv, and runs a swarm from there, outside the source tree."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import REPO

from p2p_diloco import __version__
from p2p_diloco.config import tomllib


def test_pyproject_ships_every_subpackage_and_the_presets() -> None:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(path.parent.relative_to(REPO).parts) for path in (REPO / "p2p_diloco").rglob("__init__.py")}
    assert found <= set(setuptools["packages"]), found - set(setuptools["packages"])
    assert setuptools["package-dir"] == {
        "p2p_diloco._shipped.peers": "peers",
        "p2p_diloco._shipped.bootstrap": "bootstrap",
    }


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed; its dependencies come from this environment, not the network."""
    folder = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(folder / "dist"), str(REPO)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    wheels = list((folder / "dist").glob("p2p_diloco-*.whl"))
    assert len(wheels) == 1, wheels
    venv = folder / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    # torch, hivemind and the rest are already here; a .pth adds this environment's packages without its .pth files
    # (so not the editable install of the checkout).
    (Path(site) / "deps-from-test-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheels[0])],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert pip.returncode == 0, pip.stdout[-2000:] + pip.stderr[-2000:]
    return venv


def in_venv(venv: Path, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the installed `p2p-diloco` with `args` in `cwd`, with nothing of the checkout on the path."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run(
        [str(venv / "bin" / "p2p-diloco"), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env
    )


def test_the_installed_wheel_runs_a_swarm_outside_the_source_tree(installed: Path, tmp_path: Path) -> None:
    where = subprocess.run(
        [str(installed / "bin" / "python"), "-c", "import p2p_diloco; print(p2p_diloco.__file__)"],
        capture_output=True, text=True, cwd=tmp_path, check=True,
    ).stdout.strip()  # fmt: skip
    assert where.startswith(str(installed)), where
    version = in_venv(installed, "--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.strip() == f"p2p-diloco {__version__}"
    solo = in_venv(installed, "peer", "--config", "tiny-llama", "--solo", "true", "--outer-steps", "1", cwd=tmp_path)
    assert solo.returncode == 0, solo.stderr[-2000:]  # a shipped preset, by name, with its config.json beside it
    swarm = in_venv(
        installed, "swarm", "--peers", "2", "--outer-steps", "2", "--inner-steps", "10", "--out", str(tmp_path / "run"),
        cwd=tmp_path, timeout=400,
    )  # fmt: skip
    assert swarm.returncode == 0, swarm.stdout[-2000:] + swarm.stderr[-2000:]
    assert len(list((tmp_path / "run").glob("island-*.jsonl"))) == 2
    assert in_venv(installed, "swarms", cwd=tmp_path).returncode == 0  # the shipped list of known swarms
    unknown = in_venv(installed, "peer", "--config", "no-such-preset", cwd=tmp_path)
    assert unknown.returncode == 2 and "presets: llama-150m, tiny, tiny-llama" in unknown.stderr


def test_the_service_units_parse_and_stop_cleanly() -> None:
    for unit in (REPO / "bootstrap" / "p2p-diloco-bootstrap.service", REPO / "peers" / "p2p-diloco-peer.service"):
        parser = configparser.ConfigParser(strict=True, interpolation=None)
        parser.read_string(unit.read_text())
        service = parser["Service"]
        assert service["ExecStart"].split()[0].endswith("p2p-diloco"), service["ExecStart"]
        assert service["Restart"] == "on-failure" and service["KillSignal"] == "SIGTERM"
        assert "--identity" in service["ExecStart"] and parser["Install"]["WantedBy"] == "multi-user.target"
        if shutil.which("systemd-analyze"):
            checked = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
            assert "Failed to parse" not in checked.stderr, checked.stderr


def test_the_dockerfile_enters_p2p_diloco() -> None:
    lines = [line.strip() for line in (REPO / "Dockerfile").read_text().splitlines()]
    assert any(line.startswith("ARG BASE=") for line in lines)
    assert 'ENTRYPOINT ["p2p-diloco"]' in lines
    copied = [line.split()[1] for line in lines if line.startswith("COPY ")]
    assert all((REPO / path).exists() for path in copied), copied
