"""Profiling the exchange benchmark's peers: py-spy on one averager process and perf on every process of every
peer during the timed rounds, and summaries of what they sampled."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from lib.common import REPO

if TYPE_CHECKING:
    from lib.exchange_runs import Worker

PY_SPY_RATE = 200  # how often the host polls the averaging stage (GossipExchange.average polls at the same rate)


class Profilers:
    """py-spy on one averager process and perf on every process of every peer, for the timed rounds."""

    def __init__(self, workers: list[Worker], folder: Path):
        self.folder, self.running, self.notes = folder, [], []
        self.roles: dict[int, str] = {}
        pids = []
        for worker in workers:
            roles = worker.roles()
            for process in worker.tree():
                role = roles.get(process.pid) or ("p2pd" if process.name() == "p2pd" else "other")
                self.roles[process.pid] = role
                pids.append(process.pid)
        self.averager_pid = workers[0].ready.get("averager_pid")
        py_spy = Path(sys.executable).with_name("py-spy")
        if self.averager_pid and py_spy.exists():
            self._start(
                "py-spy",
                [str(py_spy), "record", "--pid", str(self.averager_pid), "--format", "raw", "--rate", str(PY_SPY_RATE)]
                + ["--nonblocking", "--output", str(folder / "py-spy.txt")],
            )
        else:
            self.notes.append("py-spy not available: pip install py-spy")
        if _which("perf"):
            self._start(
                "perf",
                ["perf", "record", "-F", "499", "-p", ",".join(map(str, pids)), "-o", str(folder / "perf.data")],
            )
        else:
            self.notes.append("perf not available")
        time.sleep(1.0)  # let both attach before the first timed round

    def _start(self, name: str, command: list[str]) -> None:
        log = open(self.folder / f"{name}.log", "w")
        self.running.append((name, subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True), log))

    def stop(self) -> None:
        for _, process, _ in self.running:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        for name, process, log in self.running:
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                self.notes.append(f"{name} did not stop in time")
            log.close()

    def summary(self) -> dict:
        return {
            "perf": summarise_perf(self.folder / "perf.data", self.roles),
            "py_spy_averager": summarise_py_spy(self.folder / "py-spy.txt"),
            "notes": self.notes,
        }


def _which(name: str) -> bool:
    from shutil import which

    return which(name) is not None


def summarise_perf(path: Path, roles: dict[int, str], top: int = 12) -> dict | None:
    """CPU samples by peer process role, and the hottest native symbols of each role."""
    if not path.exists():
        return None
    script = subprocess.run(
        ["perf", "script", "-i", str(path), "-F", "pid,tid,ip,sym,dso"],
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    by_role: Counter[str] = Counter()
    symbols: dict[str, Counter[str]] = defaultdict(Counter)
    kernel: Counter[str] = Counter()
    for line in script.splitlines():
        parts = line.split(None, 1)
        if not parts or "/" not in parts[0]:
            continue
        pid = int(parts[0].split("/")[0])
        role = roles.get(pid, "other")
        rest = parts[1].split(None, 1)[1] if len(parts) > 1 and " " in parts[1].strip() else ""  # drop the ip
        symbol, _, dso = rest.rpartition(" (")
        dso = Path(dso.rstrip(")")).name or "?"
        symbol = symbol.strip()
        if dso.startswith("perf-") and dso.endswith(".map"):
            symbol, dso = "code without symbols", f"{role} (packed binary)" if role == "p2pd" else dso
        elif not symbol or symbol == "[unknown]":
            symbol = "?"
        if len(symbol) > 90:
            symbol = symbol[:87] + "..."
        by_role[role] += 1
        kernel[role] += dso == "[kernel.kallsyms]"
        symbols[role][f"{symbol} ({dso})"] += 1
    total = sum(by_role.values())
    if not total:
        return None
    return {
        "samples": total,
        "share_by_process": {role: count / total for role, count in by_role.most_common()},
        "kernel_share_by_process": {role: kernel[role] / count for role, count in by_role.most_common()},
        "top_symbols": {
            role: [[name, count / by_role[role]] for name, count in symbols[role].most_common(top)] for role in by_role
        },
    }


# Categories of the averager process's Python stacks: the first frame from the leaf up that matches a rule
# (a substring of its function name, or of its file path) decides.
PY_SPY_RULES = [
    ("serialize (tensor -> protobuf)", ("serialize_torch_tensor", "compress", "SerializeToString"), ()),
    ("deserialize (protobuf -> tensor)", ("deserialize_torch_tensor", "extract", "combine_from_streaming"), ()),
    ("reduce (accumulate, divide)", ("accumulate_part", "check_current_part_finished", "reset_accumulators"), ()),
    ("p2p_diloco: clone of the own averaged part", ("_local_round_trip",), ()),
    ("p2p_diloco: isfinite check of the result", ("_run_allreduce_inplace_.<locals>.<genexpr>",), ()),
    ("p2p_diloco: backup clone before the round", ("_run_allreduce_inplace_.<locals>.<listcomp>",), ()),
    ("copy of the result into the averaged buffer", ("_run_allreduce_inplace_",), ()),
    ("hivemind: result and part bookkeeping", ("register_processed_part", "iterate_output_tensors"), ()),
    ("p2p daemon I/O, Python side (protobuf framing, asyncio streams)", (), ("/p2p/", "asyncio/streams")),
    ("matchmaking and DHT", (), ("matchmaking", "key_manager", "/dht/")),
    ("uvloop event loop, C code (socket reads and writes, callbacks)", ("_run_internal",), ()),
]
# Blocking waits that py-spy's idle detection misses: executor threads on their queue, the multiprocessing
# resource sharer (torch shares the step's shared-memory buffer through it) on accept and recv.
IDLE_LEAVES = ("_worker (concurrent/futures/thread.py:81)", "socket.accept (", "Connection._recv (")


def _categorise(frames: list[str]) -> str:
    for frame in reversed(frames):
        function, _, where = frame.partition(" (")
        for name, functions, paths in PY_SPY_RULES:
            if any(f in function for f in functions) or any(p in where for p in paths):
                return name
    return "other Python"


def summarise_py_spy(path: Path, top: int = 15) -> dict | None:
    """Where the averager process's on-CPU Python time goes: categories and the hottest leaf lines."""
    if not path.exists():
        return None
    categories: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    total = idle = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        leaf = _short_frame(frames[-1])
        samples = int(count)
        if leaf.startswith(IDLE_LEAVES):
            idle += samples
            continue
        total += samples
        leaves[leaf] += samples
        categories[_categorise(frames)] += samples
    if not total:
        return None
    return {
        "samples": total,
        "blocking_wait_samples_left_out": idle,
        "rate_hz": PY_SPY_RATE,
        "categories": {name: count / total for name, count in categories.most_common()},
        "top_leaf_lines": [[name, count / total] for name, count in leaves.most_common(top)],
    }


def _short_frame(frame: str) -> str:
    """'func (path/to/site-packages/pkg/mod.py:12)' -> 'func (pkg/mod.py:12)'."""
    function, _, where = frame.partition(" (")
    where = where.rstrip(")")
    for marker in ("site-packages/", str(REPO) + "/", "/lib/python3.11/", "/lib/python3.10/", "/lib/python3.12/"):
        if marker in where:
            where = where.split(marker, 1)[1]
    return f"{function} ({where})"
