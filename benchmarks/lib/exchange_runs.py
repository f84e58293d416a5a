"""The exchange benchmark's parent side: start the peer processes of one configuration, release its rounds,
collect and summarise them, with each peer's CPU time by process role."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lib.common import BENCHMARKS
from lib.exchange_profile import Profilers
from lib.exchange_worker import BYTES_PER_VALUE, STEP_TIMEOUT, allreduce_timeout

SCRIPT = BENCHMARKS / "exchange.py"
"""The benchmark script; `--worker SYSTEM` runs one peer."""


class Worker:
    """One peer process, its protocol lines and its log."""

    def __init__(self, command: list[str], log_path: Path, interface: str = "lo"):
        self.log_path = log_path
        self._log = open(log_path, "w")
        env = dict(os.environ, GLOO_SOCKET_IFNAME=interface, PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            start_new_session=True,
            env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.ready: dict[str, Any] = {}
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def expect(self, tag: str, timeout: float) -> str:
        """The payload of the next line starting with `tag`; raise if the worker dies or is silent too long."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no {tag} within {timeout:.0f}s; log tail:\n{self.log_tail()}") from None
            if line is None:
                code = self.process.wait()
                raise RuntimeError(f"worker exited with code {code} before {tag}; log tail:\n{self.log_tail()}")
            if line.startswith(tag + " "):
                return line[len(tag) + 1 :]

    def send(self, text: str) -> None:
        try:
            self.process.stdin.write(text + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def log_tail(self, chars: int = 2000) -> str:
        self._log.flush()
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def roles(self) -> dict[int, str]:
        """pid -> role for the processes this peer reported."""
        roles = {self.process.pid: "main"}
        for key, role in (("averager_pid", "averager"), ("dht_pid", "dht")):
            if key in self.ready:
                roles[self.ready[key]] = role
        return roles

    def tree(self) -> list[Any]:
        """This peer's process and all its descendants (averager, DHT, p2pd...)."""
        import psutil

        try:
            parent = psutil.Process(self.process.pid)
            return [parent, *parent.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def request_exit(self) -> None:
        """Ask the peer to shut down cleanly."""
        if self.process.poll() is None:
            self.send("EXIT")
            try:
                self.process.stdin.close()
            except OSError:
                pass

    def stop(self, deadline: float) -> None:
        """Wait for the peer until `deadline` (monotonic), then kill its whole process tree and session."""
        from p2p_diloco.process import kill_process_tree

        try:
            self.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        kill_process_tree(self.process.pid)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()
        self._log.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_snapshot(workers: list[Worker]) -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far) for every process of every peer."""
    import psutil

    snapshot = {}
    for worker in workers:
        roles = worker.roles()
        for process in worker.tree():
            try:
                times = process.cpu_times()
                role = roles.get(process.pid) or ("p2pd" if process.name() == "p2pd" else "other")
                snapshot[process.pid] = (role, times.user + times.system)
            except psutil.NoSuchProcess:
                continue
    return snapshot


def machine_busy() -> float:
    """CPU seconds the whole machine has been busy (all cores)."""
    import psutil

    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def pss_mb(workers: list[Worker]) -> float:
    """Mean proportional set size of one peer (all its processes), MB."""
    import psutil

    total = 0.0
    for worker in workers:
        for process in worker.tree():
            try:
                total += process.memory_full_info().pss
            except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
                continue
    return total / max(1, len(workers)) / 1e6


class TimedRounds:
    """Warm-up, then timed rounds on every peer at once, with CPU accounting (and profilers) around the timed ones."""

    def __init__(
        self, workers: list[Worker], values: int, profile_dir: Path | None, wire: Callable[[], int] | None = None
    ):
        self.workers, self.values, self.profile_dir = workers, values, profile_dir
        self.profilers: Profilers | None = None
        self.wire = wire
        """Bytes every peer has sent on its link so far (all hosts together), when peers sit on their own hosts."""

    def run(self, warmup: int, rounds: int) -> list[list[dict]]:
        """Every peer's record of every timed round."""
        round_timeout = allreduce_timeout(self.values) + STEP_TIMEOUT + 60
        records: list[list[dict]] = []
        for index in range(warmup + rounds):
            if index == warmup:
                if self.profile_dir is not None:
                    self.profilers = Profilers(self.workers, self.profile_dir)
                self.cpu_before, self.busy_before, self.wall_before = (
                    cpu_snapshot(self.workers),
                    machine_busy(),
                    time.monotonic(),
                )
                self.wire_before = self.wire() if self.wire else 0
            for worker in self.workers:
                worker.send("GO")
            results = [json.loads(worker.expect("ROUND", round_timeout)) for worker in self.workers]
            if index >= warmup:
                records.append(results)
        self.wall = time.monotonic() - self.wall_before
        self.cpu_after, self.busy_after = cpu_snapshot(self.workers), machine_busy()
        self.wire_after = self.wire() if self.wire else 0
        if self.profilers is not None:
            self.profilers.stop()
        return records

    def usage(self, records: list[list[dict]], rounds: int) -> dict:
        """CPU by process role per timed round, its share of the machine, other load, memory and the profile."""
        cpu: Counter[str] = Counter()
        for pid, (role, seconds) in self.cpu_after.items():
            cpu[role] += seconds - self.cpu_before.get(pid, (role, 0.0))[1]
        cpu["main"] -= sum(r.get("check_cpu_s", 0.0) for results in records for r in results)
        ours = sum(cpu.values())
        usage = {
            "cpu_s_per_round": {role: seconds / rounds for role, seconds in cpu.most_common()},
            "cpu_s_per_round_total": ours / rounds,
            "cpu_busy_fraction": ours / (self.wall * (os.cpu_count() or 1)),
            "other_load_cpu_s_per_round": max(0.0, (self.busy_after - self.busy_before) - ours) / rounds,
            "pss_mb_per_peer": pss_mb(self.workers),
        }
        if self.wire is not None:  # Ethernet frames: payload plus TCP/IP, TLS, yamux and every DHT message
            usage["wire_bytes_per_peer_per_round"] = (self.wire_after - self.wire_before) / rounds / len(self.workers)
        if self.profilers is not None:
            usage["profile"] = self.profilers.summary()
        return usage

    def close(self) -> None:
        """Stop the profilers if a failure left them running."""
        if self.profilers is not None and any(p.poll() is None for _, p, _ in self.profilers.running):
            self.profilers.stop()


def start_workers(
    system: str, peers: int, command: list[str], log_prefix: str, logs: Path, hosts: list[Any] | None = None
) -> list[Worker]:
    """Start `peers` workers of one system and wait until each is READY.

    With `hosts` (benchmarks.lib.netns Hosts), worker r runs on host r and listens on that host's address.
    """

    def start(rank: int, *extra: str) -> Worker:
        log = logs / f"{log_prefix}-rank{rank}.log"
        if hosts is None:
            return Worker([*command, "--rank", str(rank), *extra], log)
        host = hosts[rank]
        placed = [*host.prefix, *command, "--rank", str(rank), "--host", host.address, *extra]
        return Worker(placed, log, interface="eth0")

    workers: list[Worker] = []
    try:
        if system == "gloo":
            port = 29500 if hosts else free_port()  # each host is a fresh namespace: any port is free there
            master = hosts[0].address if hosts else "127.0.0.1"
            for rank in range(peers):
                workers.append(start(rank, "--port", str(port), "--master", master))
        else:  # all import at once; the others start their DHT node once the first one's address is known
            for rank in range(peers):
                workers.append(start(rank))
            workers[0].ready = json.loads(workers[0].expect("READY", 180))
            for worker in workers[1:]:
                worker.send(f"PEERS {workers[0].ready['maddr']}")
        for worker in workers:
            if not worker.ready:
                worker.ready = json.loads(worker.expect("READY", 180))
    except BaseException:
        stop_workers(workers)
        raise
    return workers


def stop_workers(workers: list[Worker]) -> None:
    """Ask every worker to exit, then kill what is left of them after 15 s."""
    for worker in workers:
        worker.request_exit()
    deadline = time.monotonic() + 15
    for worker in workers:
        worker.stop(deadline)


def run_config(
    system: str,
    values: int,
    peers: int,
    *,
    warmup: int,
    rounds: int,
    logs: Path,
    socket_dir: Path,
    profile_dir: Path | None = None,
    codec: str = "fp32",
    part_size: int | None = None,
    hosts: list[Any] | None = None,
    wire: Callable[[], int] | None = None,
    uplink_mbit: float = 0.0,
) -> dict:
    """Start `peers` workers of one system, run warm-up and timed rounds; return the row."""
    command = [sys.executable, str(SCRIPT), "--worker", system, "--peers", str(peers)]
    command += ["--values", str(values), "--socket-dir", str(socket_dir), "--codec", codec]
    if uplink_mbit:
        command += ["--uplink-mbit", str(uplink_mbit)]
    if part_size:
        command += ["--part-size", str(part_size)]
    if profile_dir is not None:
        command.append("--no-check")
    name = f"{system}-{values}-{peers}"
    workers: list[Worker] = []
    row: dict[str, Any] = {"values": values, "peers": peers, "system": system, "codec": codec}
    if part_size:
        row["part_size_bytes"] = part_size
    started = time.monotonic()
    timed = None
    try:
        workers = start_workers(system, peers, command, name, logs, hosts)
        row["startup_s"] = time.monotonic() - started
        timed = TimedRounds(workers, values, profile_dir, wire)
        records = timed.run(warmup, rounds)
        row.update(summarise_rounds(records, values))
        row.update(timed.usage(records, rounds))
    except Exception as exc:
        row.update(seconds=None, gb_per_s=None, correct=False, error=f"{type(exc).__name__}: {exc}")
        print(f"   {name} failed: {exc}", flush=True)
    finally:
        if timed is not None:
            timed.close()
        stop_workers(workers)
    row["wall_s"] = time.monotonic() - started
    return row


def summarise_rounds(records: list[list[dict]], values: int) -> dict:
    """A row's numbers from its timed rounds (each a list of per-peer records)."""
    per_round = [max(record["seconds"] for record in results) for results in records]
    seconds = statistics.median(per_round)

    def phase(key: str) -> float | None:
        found = [[r[key] for r in results if key in r] for results in records]
        found = [statistics.mean(f) for f in found if f]
        return statistics.median(found) if found else None

    errors = sorted({r["error"] for results in records for r in results if r.get("error")})
    summary = {
        "seconds": seconds,
        "gb_per_s": values * BYTES_PER_VALUE / seconds / 1e9,
        "correct": all(r["ok"] for results in records for r in results),
        "max_abs_error": max(
            (r["max_abs_error"] for results in records for r in results if r["max_abs_error"] is not None),
            default=None,
        ),
        "seconds_per_round": per_round,
        "seconds_min": min(per_round),
        "seconds_whole_call": statistics.median(
            max(record.get("seconds_with_copies", record["seconds"]) for record in results) for results in records
        ),
        "groups": sorted({r["group"] for results in records for r in results}),
        "phases_s": {
            key: phase(key)
            for key in ("matchmaking_s", "allreduce_s", "copy_in_s", "copy_out_s", "barrier_s", "seconds_with_copies")
            if phase(key) is not None
        },
    }
    if any("bytes_sent" in r for results in records for r in results):
        summary["bytes_sent_per_peer_per_round"] = phase("bytes_sent")
        summary["bytes_recv_per_peer_per_round"] = phase("bytes_recv")
    if any("streams_repaired" in r for results in records for r in results):
        summary["streams_repaired"] = sum(r.get("streams_repaired", 0) for results in records for r in results)
    if errors:
        summary["errors"] = errors
    failures = [
        {"round": index, "rank": rank, **{k: r.get(k) for k in ("group", "max_abs_error", "error")}}
        for index, results in enumerate(records)
        for rank, r in enumerate(results)
        if not r["ok"]
    ]
    if failures:  # e.g. a round that reported success with a result far from the mean (a silent partial average)
        summary["failures"] = failures
    return summary
