"""The one launcher of local swarms: a bootstrap and islands as separate processes, stopped together, no orphans.

Used by `p2p-diloco swarm`, every benchmark and the tests. Each child runs in its own session (so a signal can
reach its whole process group), dies with the launcher (a parent-death signal), and is stopped with SIGTERM,
then SIGKILL of its whole session. A child can be placed in a network namespace with `command_prefix`
(e.g. `["ip", "netns", "exec", "host-a"]`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from p2p_diloco.process import die_with_parent, kill_process_tree
from p2p_diloco.timeouts import CHILD_STOP_S
from p2p_diloco.train.metrics import read_metrics


def _child_setup() -> None:
    die_with_parent(signal.SIGTERM)


def spawn(
    args: list[str],
    log_path: Path | None = None,
    command_prefix: Sequence[str] = (),
    program: Sequence[str] = ("-m", "p2p_diloco"),
    **kwargs,
) -> subprocess.Popen:
    """Start `python -m p2p_diloco ARGS` (or `python PROGRAM ARGS`) in its own session, dying with this process.

    Its output goes to `log_path` when given (else wherever `stdout=`/`stderr=` say).
    """
    stdout = open(log_path, "w") if log_path is not None else kwargs.pop("stdout", None)  # noqa: SIM115
    return subprocess.Popen(
        [*command_prefix, sys.executable, *program, *args],
        stdout=stdout,
        stderr=subprocess.STDOUT if log_path is not None else kwargs.pop("stderr", None),
        start_new_session=True,
        preexec_fn=_child_setup,
        **kwargs,
    )


def stop(process: subprocess.Popen, grace: float = CHILD_STOP_S) -> None:
    """SIGTERM a child (it shuts its own children down), then SIGKILL its whole session after `grace` seconds."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    kill_process_tree(process.pid)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def read_bootstrap_maddrs(process: subprocess.Popen) -> list[str]:
    """The multiaddrs a starting bootstrap prints on its (text) stdout; stops it if it prints none.

    The line it prints for peers to paste is kept as `process.join_line`.
    """
    maddrs = []
    for line in process.stdout:
        if line.startswith("MADDR "):
            maddrs.append(line.split()[1])
        if line.strip().startswith("p2p-diloco peer --initial-peers"):
            process.join_line = line.strip()
            break
    if not maddrs:
        stop(process)
        raise RuntimeError("the bootstrap exited before printing its multiaddrs")
    return maddrs


def start_bootstrap(
    out: Path,
    run_id: str = "local-swarm",
    host: str | None = "127.0.0.1",
    command_prefix: Sequence[str] = (),
    extra_args: Sequence[str] = (),
) -> tuple[subprocess.Popen, list[str]]:
    """Start a bootstrap listening on `host` (None: its defaults) and return it with the multiaddrs it prints."""
    out.mkdir(parents=True, exist_ok=True)
    args = ["bootstrap", "--run-id", run_id] + ([] if host is None else ["--host-maddrs", f"/ip4/{host}/tcp/0"])
    args += ["--maddrs-file", str(out / "bootstrap.maddrs"), *extra_args]
    with open(out / "bootstrap.log", "a") as log:  # its logs; stdout carries the multiaddrs it prints
        process = spawn(args, stdout=subprocess.PIPE, stderr=log, text=True, command_prefix=command_prefix)
    return process, read_bootstrap_maddrs(process)


@dataclass
class PeerProcess:
    """A `p2p-diloco peer` child process with its metrics and log files."""

    name: str
    process: subprocess.Popen
    metrics: Path
    log: Path
    checkpoint_dir: Path
    args: list[str] = field(default_factory=list)
    """The full argument list it was started with (to start it again)."""
    command_prefix: Sequence[str] = ()

    def records(self) -> list[dict]:
        """Metrics records written so far."""
        return read_metrics(self.metrics) if self.metrics.exists() else []

    def log_text(self) -> str:
        """Everything the peer printed."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    @property
    def running(self) -> bool:
        """True until the process exits."""
        return self.process.poll() is None

    def wait(self, timeout: float) -> int:
        """Wait for the peer to exit; TimeoutError with its log tail if it does not."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(
                f"{self.name} did not finish in {timeout:.0f}s; log tail:\n{self.log_text()[-3000:]}"
            ) from None

    def signal_group(self, sig: int) -> None:
        """Send `sig` to the peer's whole process group (as a terminal's Ctrl-C does).

        SIGSTOP and SIGCONT freeze or wake the whole island, p2pd included (it runs in a process group of its own),
        as a stalled machine would.
        """
        os.killpg(self.process.pid, sig)
        if sig in (signal.SIGSTOP, signal.SIGCONT):
            kill_process_tree(self.process.pid, sig)


class LocalSwarm:
    """A bootstrap and peers as separate processes; `close()` stops every one of them and their sessions."""

    def __init__(self, folder: Path, *, run_id: str = "test"):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id
        self.children: list[subprocess.Popen] = []
        self.peers: dict[str, PeerProcess] = {}
        self.maddrs: list[str] = []

    def bootstrap(
        self, *, host: str | None = "127.0.0.1", command_prefix: Sequence[str] = (), extra_args: Sequence[str] = ()
    ) -> list[str]:
        """Start the bootstrap; return its multiaddrs."""
        process, self.maddrs = start_bootstrap(self.folder, self.run_id, host, command_prefix, extra_args)
        self.children.append(process)
        self.bootstrap_process = process
        return self.maddrs

    def peer(
        self,
        name: str,
        *args: str,
        config: Path | str | None = None,
        join: bool = True,
        command_prefix: Sequence[str] = (),
        fresh_metrics: bool = False,
        checkpoints: bool = True,
        host: str | None = "127.0.0.1",
        program: Sequence[str] | None = None,
    ) -> PeerProcess:
        """Start one island named `name`; by default it joins this swarm's bootstrap with this swarm's run id.

        It writes `NAME.jsonl` (appended to across restarts unless `fresh_metrics`), `NAME.log` and, with
        `checkpoints`, checkpoints in `NAME-ckpt/`; `args` are more `p2p-diloco peer` flags. It listens on
        `host` (a local swarm stays on 127.0.0.1), or on the island's defaults for None. `program` runs another
        script instead of `p2p-diloco peer` (given the same flags), e.g. a test's hostile island.
        """
        metrics = self.folder / f"{name}.jsonl"
        if fresh_metrics:
            metrics.unlink(missing_ok=True)
        checkpoint_dir = self.folder / f"{name}-ckpt"
        command = ["peer", "--metrics", str(metrics)]
        if checkpoints and "--checkpoint-dir" not in args:
            command += ["--checkpoint-dir", str(checkpoint_dir)]
        if config is not None:
            command += ["--config", str(config)]
        if join:
            command += ["--initial-peers", *self.maddrs]
        if "--run-id" not in args:
            command += ["--run-id", self.run_id]
        if host is not None and "--host-maddrs" not in args:
            command += ["--host-maddrs", f"/ip4/{host}/tcp/0"]
        command += list(args)
        if program is not None:
            command = [*program[1:], *command[1:]]
            return self._start(name, command, command_prefix, metrics, checkpoint_dir, (program[0],))
        return self._start(name, command, command_prefix, metrics, checkpoint_dir)

    def restart(self, name: str, command_prefix: Sequence[str] | None = None) -> PeerProcess:
        """Start a peer again with the arguments it was first started with (its log gets a new file), under its
        first command prefix or `command_prefix`."""
        old = self.peers[name]
        prefix = old.command_prefix if command_prefix is None else command_prefix
        return self._start(name, old.args, prefix, old.metrics, old.checkpoint_dir)

    def standby(self, name: str, *extra: str) -> PeerProcess:
        """Start a standby for peer `name`: its flags (then `extra`) plus `--standby true`, its checkpoint folder and
        metrics file, a log of its own (`NAME.standby-N.log`); it takes over when the peer stops or dies (`promote`
        it then)."""
        old = self.peers[name]
        log = self.folder / f"{name}.standby-{len(self.children)}.log"
        command = [*old.args, *extra, "--standby", "true"]
        process = spawn(command, log_path=log, command_prefix=old.command_prefix)
        self.children.append(process)
        return PeerProcess(name, process, old.metrics, log, old.checkpoint_dir, old.args, old.command_prefix)

    def promote(self, standby: PeerProcess) -> None:
        """Make a standby that took over the peer of its name (`LocalSwarm.peers`)."""
        self.peers[standby.name] = standby

    def _start(
        self,
        name: str,
        command: list[str],
        prefix: Sequence[str],
        metrics: Path,
        checkpoint_dir: Path,
        program: Sequence[str] = ("-m", "p2p_diloco"),
    ) -> PeerProcess:
        log = self.folder / f"{name}.log"
        if name in self.peers:  # a restart: keep the earlier log
            log = self.folder / f"{name}.log.{int(time.monotonic() * 1000)}"
        process = spawn(command, log_path=log, command_prefix=prefix, program=program)
        self.children.append(process)
        self.peers[name] = PeerProcess(name, process, metrics, log, checkpoint_dir, command, prefix)
        return self.peers[name]

    def wait(self, timeout: float) -> dict[str, int | None]:
        """Wait until every peer has exited (or `timeout` seconds pass); their exit codes by name."""
        deadline = time.monotonic() + timeout
        for peer in self.peers.values():
            try:
                peer.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        return {name: peer.process.poll() for name, peer in self.peers.items()}

    def records(self) -> dict[str, list[dict]]:
        """Every peer's metrics records so far, by name."""
        return {name: peer.records() for name, peer in self.peers.items()}

    def close(self, grace: float = CHILD_STOP_S) -> None:
        """Stop every child process and its whole session (frozen ones are woken first)."""
        for child in reversed(self.children):
            if child.poll() is None:
                try:
                    os.killpg(child.pid, signal.SIGCONT)
                except (ProcessLookupError, PermissionError):
                    pass
            stop(child, grace=grace)

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
