"""Exchange speed: averaging one flat fp32 pseudo-gradient among peer processes on 127.0.0.1.

Three systems average the same vector: p2p-diloco's own exchange path (`GossipExchange.average`, an
all-or-nothing all-reduce on hivemind's DecentralizedAverager), hivemind's `DecentralizedAverager` used
directly, and `torch.distributed.all_reduce` over gloo. Every peer is a separate process started by this
script (`--worker` mode); the parent releases each round on all peers at once with a "GO" line on stdin and
reads one "ROUND <json>" line back from each. Each round is checked against the true mean.

    python benchmarks/exchange.py            # 10M and 50M values x 2 and 4 peers, plus a profile run
    python benchmarks/exchange.py --quick    # 10M values x 2 and 4 peers, plus a profile run
    python benchmarks/exchange.py --smoke    # 1M values, 2 peers, 1 timed round (used by the tests)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import queue
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from common import machine

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SYSTEMS = ("gloo", "hivemind", "p2p_diloco")
BYTES_PER_VALUE = 4
TOLERANCE = 1e-5

# Matchmaking settings shared by both hivemind-based systems: the group starts as soon as it is full.
MIN_MATCHMAKING_TIME = 1.0
REQUEST_TIMEOUT = 0.5
NEXT_CHUNK_TIMEOUT = 30.0
STEP_TIMEOUT = 60.0  # seconds to find the group
SOCKET_DIR = Path("/tmp")  # replaced by a private folder for each run (see worker())
POLL_S = 0.005
PY_SPY_RATE = 200  # how often the host polls the averaging stage (GossipExchange.average polls at the same rate)


def allreduce_timeout(values: int) -> float:
    """A bound on one all-reduce that a healthy round never approaches (~0.15 s per million values seen)."""
    return max(60.0, 3.0 * values / 1e6)


# --------------------------------------------------------------------------------------------------------------
# Worker: one peer process
# --------------------------------------------------------------------------------------------------------------


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (as p2p_diloco.process does, without importing hivemind)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def make_vectors(rank: int, peers: int, values: int) -> tuple[Any, Any]:
    """This peer's contribution and the true mean over all peers, without materialising the other peers' vectors.

    Peer r contributes base + (r + 1) * ramp, so the mean is base + (peers + 1) / 2 * ramp.
    """
    import torch

    base = torch.randn(values, generator=torch.Generator().manual_seed(1234))
    ramp = torch.linspace(-1.0, 1.0, values)
    vector = ramp.mul(rank + 1.0).add_(base)
    expected = ramp.mul_((peers + 1) / 2).add_(base)
    return vector, expected


def max_error(result: Any, expected: Any) -> float | None:
    """Largest absolute deviation from the true mean (None when there is no result or it is not finite)."""
    if result is None:
        return None
    error = float((result - expected).abs().max())
    return error if math.isfinite(error) else None


def _hivemind_round(averager: Any, vector: Any) -> tuple[dict, Any]:
    from hivemind.averaging.control import AveragingStage

    t0 = time.perf_counter()
    with averager.get_tensors() as tensors:
        tensors[0].copy_(vector)
    t_in = time.perf_counter()
    control = averager.step(weight=1.0, timeout=STEP_TIMEOUT, wait=False)
    while not control.done() and control.stage != AveragingStage.RUNNING_ALLREDUCE:
        time.sleep(POLL_S)
    t_allreduce = time.perf_counter()
    error = None
    try:
        gathered = control.result(timeout=averager._allreduce_timeout + 30)
        group = len(gathered) if gathered else 0
    except Exception as exc:  # a failed round is recorded, not fatal
        error, group = f"{type(exc).__name__}: {exc}", 0
    t_done = time.perf_counter()
    with averager.get_tensors() as tensors:
        result = tensors[0].clone()
    t_out = time.perf_counter()
    return {
        "seconds": t_done - t_in,
        "matchmaking_s": t_allreduce - t_in,
        "allreduce_s": t_done - t_allreduce,
        "copy_in_s": t_in - t0,
        "copy_out_s": t_out - t_done,
        "seconds_with_copies": t_out - t0,
        "group": group,
        "error": error,
    }, (result if error is None else None)


def _p2p_round(exchange: Any, vector: Any) -> tuple[dict, Any]:
    t0 = time.perf_counter()
    result = exchange.average(vector, {}, weight=1.0, grace_s=0.0, timeout=STEP_TIMEOUT)
    t1 = time.perf_counter()
    return {
        # The whole API call: copy-in, matchmaking, all-reduce (with backup and checks), clone of the result.
        "seconds": t1 - t0,
        "matchmaking_s": result.matchmaking_s,  # includes the copy into the averager's buffer
        "allreduce_s": (t1 - t0) - result.matchmaking_s,  # includes the clone of the result
        "seconds_with_copies": t1 - t0,
        "group": 1 + len(result.partners) if result.merged is not None else 0,
        "bytes_sent": result.bytes_sent,
        "bytes_recv": result.bytes_recv,
        "error": result.error,
    }, result.merged


def _gloo_round(dist: Any, buffer: Any, vector: Any, peers: int) -> tuple[dict, Any]:
    t0 = time.perf_counter()
    buffer.copy_(vector)
    t_in = time.perf_counter()
    dist.barrier()
    t_start = time.perf_counter()
    dist.all_reduce(buffer)
    buffer.div_(peers)
    t_done = time.perf_counter()
    return {
        "seconds": t_done - t_start,
        "matchmaking_s": 0.0,
        "allreduce_s": t_done - t_start,
        "copy_in_s": t_in - t0,
        "barrier_s": t_start - t_in,
        "seconds_with_copies": (t_done - t_start) + (t_in - t0),
        "group": peers,
        "error": None,
    }, buffer


def worker(args: argparse.Namespace) -> int:
    """One peer: set up the system, print READY, then run one round per GO line until EXIT or end of input."""
    die_with_parent()  # never outlive the benchmark (its children die with this process in turn)
    import torch

    system, rank, peers, values = args.worker, args.rank, args.peers, args.values
    ready: dict[str, Any] = {"pid": os.getpid()}
    cleanup = []
    try:
        if system == "gloo":
            import torch.distributed as dist

            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{args.port}",
                rank=rank,
                world_size=peers,
                timeout=datetime.timedelta(seconds=allreduce_timeout(values) + 60),
            )
            cleanup.append(dist.destroy_process_group)
            buffer = torch.zeros(values)
        else:
            from hivemind.averaging import DecentralizedAverager
            from hivemind.compression import NoCompression
            from hivemind.p2p import P2P

            from p2p_diloco.net.dht import shutdown_dht, start_dht

            if args.socket_dir:
                # hivemind puts its daemon's unix sockets in /tmp, where the test suite's no_leftover_daemons
                # fixture unlinks every new hivemind-*.sock, live or not; a test session running meanwhile on
                # the same machine would cut this peer off from its p2pd. Keep them in a folder of our own.
                P2P._UNIX_SOCKET_PREFIX = f"/unix{args.socket_dir}/hivemind-"

            initial_peers = args.initial_peers
            if args.rank > 0 and not initial_peers:  # imports done: now wait for the first peer's address
                line = sys.stdin.readline().split()
                assert line and line[0] == "PEERS", f"expected PEERS, got {line}"
                initial_peers = line[1:]
            dht = start_dht(
                initial_peers=initial_peers,
                host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                announce_maddrs=[],
                identity=None,
                timeout=60,
            )
            cleanup.append(lambda: shutdown_dht(dht))
            ready.update(maddr=str(dht.get_visible_maddrs()[0]), dht_pid=dht.pid)
            timeouts = dict(
                min_matchmaking_time=MIN_MATCHMAKING_TIME,
                request_timeout=REQUEST_TIMEOUT,
                allreduce_timeout=allreduce_timeout(values),
                next_chunk_timeout=NEXT_CHUNK_TIMEOUT,
            )
            if system == "hivemind":

                class Averager(DecentralizedAverager):
                    """hivemind's averager, unchanged except that it dies with this process."""

                    def run(self) -> None:
                        die_with_parent()
                        super().run()

                averager = Averager(
                    [torch.zeros(values)],
                    dht=dht,
                    prefix="exchange_bench",
                    start=True,
                    target_group_size=peers,
                    min_group_size=peers,
                    compression=NoCompression(),
                    declare_state_period=10.0,
                    shutdown_timeout=3.0,
                    **timeouts,
                )
            else:
                from p2p_diloco.net.exchange import GossipExchange

                exchange = GossipExchange(
                    dht,
                    run_id="exchange_bench",
                    size=values,
                    state_provider=lambda: ({}, []),
                    target_group_size=peers,
                    quorum=peers,
                    **timeouts,
                )
                averager = exchange.averager
            # Nothing of the averager's state matters at exit: kill it rather than wait for its shutdown timeout.
            cleanup.insert(0, lambda: (averager.kill(), averager.join(5)))
            ready["averager_pid"] = averager.pid
        vector, expected = make_vectors(rank, peers, values)
        print("READY " + json.dumps(ready), flush=True)
        for line in sys.stdin:
            command = line.strip()
            if command == "EXIT":
                break
            if command != "GO":
                continue
            if system == "gloo":
                record, result = _gloo_round(dist, buffer, vector, peers)
            elif system == "hivemind":
                record, result = _hivemind_round(averager, vector)
            else:
                record, result = _p2p_round(exchange, vector)
            if args.no_check:  # profiled runs: keep the check's own CPU out of the samples
                record["max_abs_error"], record["ok"] = None, record["error"] is None and result is not None
            else:
                cpu0 = time.process_time()
                record["max_abs_error"] = max_error(result, expected)
                record["check_cpu_s"] = time.process_time() - cpu0  # not part of any system's cost
                error = record["max_abs_error"]
                record["ok"] = record["error"] is None and error is not None and error <= TOLERANCE
            del result
            print("ROUND " + json.dumps(record), flush=True)
    finally:
        for step in cleanup:
            try:
                step()
            except Exception as exc:  # best effort: the parent kills whatever is left
                print(f"# cleanup: {exc!r}", file=sys.stderr, flush=True)
    return 0


# --------------------------------------------------------------------------------------------------------------
# Parent: start peers, release rounds, collect results
# --------------------------------------------------------------------------------------------------------------


class Worker:
    """One peer process, its protocol lines and its log."""

    def __init__(self, command: list[str], log_path: Path):
        self.log_path = log_path
        self._log = open(log_path, "w")
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
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


def run_config(
    system: str,
    values: int,
    peers: int,
    *,
    warmup: int,
    rounds: int,
    logs: Path,
    profile_dir: Path | None = None,
) -> dict:
    """Start `peers` workers of one system, run warm-up and timed rounds; return the row."""
    base = [sys.executable, str(Path(__file__).resolve()), "--worker", system, "--peers", str(peers)]
    base += ["--values", str(values), "--socket-dir", str(SOCKET_DIR)]
    if profile_dir is not None:
        base.append("--no-check")
    name = f"{system}-{values}-{peers}"
    workers: list[Worker] = []
    row: dict[str, Any] = {"values": values, "peers": peers, "system": system}
    started = time.monotonic()
    profilers = None
    try:
        if system == "gloo":
            port = free_port()
            for rank in range(peers):
                command = [*base, "--rank", str(rank), "--port", str(port)]
                workers.append(Worker(command, logs / f"{name}-rank{rank}.log"))
        else:  # all import at once; the others start their DHT node once the first one's address is known
            for rank in range(peers):
                workers.append(Worker([*base, "--rank", str(rank)], logs / f"{name}-rank{rank}.log"))
            workers[0].ready = json.loads(workers[0].expect("READY", 180))
            for worker in workers[1:]:
                worker.send(f"PEERS {workers[0].ready['maddr']}")
        for worker in workers:
            if not worker.ready:
                worker.ready = json.loads(worker.expect("READY", 180))
        row["startup_s"] = time.monotonic() - started
        round_timeout = allreduce_timeout(values) + STEP_TIMEOUT + 60
        records: list[list[dict]] = []
        cpu_before = busy_before = wall_before = None
        for index in range(warmup + rounds):
            if index == warmup:
                if profile_dir is not None:
                    profilers = Profilers(workers, profile_dir)
                cpu_before, busy_before, wall_before = cpu_snapshot(workers), machine_busy(), time.monotonic()
            for worker in workers:
                worker.send("GO")
            results = [json.loads(worker.expect("ROUND", round_timeout)) for worker in workers]
            if index >= warmup:
                records.append(results)
        wall = time.monotonic() - wall_before
        cpu_after, busy_after = cpu_snapshot(workers), machine_busy()
        if profilers is not None:
            profilers.stop()
        row.update(summarise_rounds(records, values))
        cpu: Counter[str] = Counter()
        for pid, (role, seconds) in cpu_after.items():
            cpu[role] += seconds - cpu_before.get(pid, (role, 0.0))[1]
        cpu["main"] -= sum(r.get("check_cpu_s", 0.0) for results in records for r in results)
        ours = sum(cpu.values())
        row["cpu_s_per_round"] = {role: seconds / rounds for role, seconds in cpu.most_common()}
        row["cpu_s_per_round_total"] = ours / rounds
        row["cpu_busy_fraction"] = ours / (wall * (os.cpu_count() or 1))
        row["other_load_cpu_s_per_round"] = max(0.0, (busy_after - busy_before) - ours) / rounds
        row["pss_mb_per_peer"] = pss_mb(workers)
        if profilers is not None:
            row["profile"] = profilers.summary()
    except Exception as exc:
        row.update(seconds=None, gb_per_s=None, correct=False, error=f"{type(exc).__name__}: {exc}")
        print(f"   {name} failed: {exc}", flush=True)
    finally:
        if profilers is not None and any(p.poll() is None for _, p, _ in profilers.running):
            profilers.stop()
        for worker in workers:
            worker.request_exit()
        deadline = time.monotonic() + 15
        for worker in workers:
            worker.stop(deadline)
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


def add_ratios(rows: list[dict]) -> None:
    gloo = {(r["values"], r["peers"]): r["seconds"] for r in rows if r["system"] == "gloo"}
    for row in rows:
        reference = gloo.get((row["values"], row["peers"]))
        row["ratio_to_gloo"] = row["seconds"] / reference if row.get("seconds") and reference else None


def profile_summary(rows: list[dict], profile_rows: list[dict]) -> dict:
    """Where the time of the hivemind-based paths goes, in numbers and in words."""
    phases = {
        f"{r['system']} {r['values'] // 1_000_000}M x{r['peers']}": {
            "seconds": r.get("seconds"),
            **r.get("phases_s", {}),
            "cpu_s_per_round": r.get("cpu_s_per_round"),
        }
        for r in rows
        if r["system"] != "gloo" and r.get("seconds")
    }
    lines = []
    for r in rows:
        if r["system"] == "gloo" or not r.get("seconds"):
            continue
        p, cpu = r.get("phases_s", {}), r.get("cpu_s_per_round", {})
        total = sum(cpu.values()) or 1.0
        shares = ", ".join(f"{role} {seconds / total:.0%}" for role, seconds in cpu.items() if seconds / total >= 0.02)
        lines.append(
            f"{r['system']} {r['values'] / 1e6:.0f}M values x {r['peers']} peers: {r['seconds']:.2f} s/round = "
            f"matchmaking {p.get('matchmaking_s', 0):.2f} s + all-reduce {p.get('allreduce_s', 0):.2f} s "
            f"({r.get('ratio_to_gloo') or float('nan'):.1f}x gloo); CPU {total:.2f} s/round "
            f"({r.get('cpu_busy_fraction', 0):.0%} of all cores): {shares}"
        )
    result: dict[str, Any] = {"phases": phases, "summary": lines, "profiled_runs": []}
    for row in profile_rows:
        prof = row.get("profile") or {}
        result["profiled_runs"].append(
            {
                "system": row["system"],
                "values": row["values"],
                "peers": row["peers"],
                "seconds_under_profilers": row.get("seconds"),
                "correct": row.get("correct"),
                "cpu_s_per_round": row.get("cpu_s_per_round"),
                **prof,
            }
        )
        head = f"profile {row['system']} {row['values'] / 1e6:g}M x {row['peers']}"
        if row.get("error"):
            lines.append(f"{head}: failed: {row['error']}")
            continue
        perf = prof.get("perf")
        if perf:
            lines.append(
                f"{head}, perf, CPU samples by process (kernel part): "
                + ", ".join(
                    f"{role} {share:.0%} ({perf['kernel_share_by_process'][role]:.0%})"
                    for role, share in perf["share_by_process"].items()
                )
            )
            for role in ("averager", "p2pd", "main"):
                tops = perf["top_symbols"].get(role, [])[:6]
                if tops:
                    lines.append(f"{head}, perf, hottest in {role}: " + "; ".join(f"{n} {s:.0%}" for n, s in tops))
        spy = prof.get("py_spy_averager")
        if spy:
            lines.append(
                f"{head}, py-spy, averager process on-CPU Python stacks: "
                + ", ".join(f"{name} {share:.0%}" for name, share in spy["categories"].items())
            )
    return result


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("torch", "hivemind", "p2p-diloco"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def plot(rows: list[dict], path: Path) -> None:
    """Seconds per round and effective GB/s per configuration, one bar per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({(r["values"], r["peers"]) for r in rows})
    labels = [f"{values / 1e6:g}M values\n{peers} peers" for values, peers in configs]
    by_key = {(r["values"], r["peers"], r["system"]): r for r in rows}
    colors = {"gloo": "tab:green", "hivemind": "tab:orange", "p2p_diloco": "tab:blue"}
    width = 0.8 / len(SYSTEMS)
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    for axis, key, title in (
        (axes[0], "seconds", "seconds per round, log scale (lower is better)"),
        (axes[1], "gb_per_s", "effective GB/s = values x 4 B / seconds (higher is better)"),
    ):
        for offset, system in enumerate(SYSTEMS):
            xs = [i + (offset - 1) * width for i in range(len(configs))]
            heights = [(by_key.get((v, p, system)) or {}).get(key) or 0 for v, p in configs]
            bars = axis.bar(xs, heights, width, label=system, color=colors[system])
            if key == "seconds":
                for bar, (v, p) in zip(bars, configs):
                    ratio = (by_key.get((v, p, system)) or {}).get("ratio_to_gloo")
                    if ratio and system != "gloo":
                        axis.annotate(
                            f"{ratio:.1f}x",
                            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center",
                            va="bottom",
                            fontsize=8,
                        )
        axis.set_xticks(range(len(configs)), labels, fontsize=9)
        axis.set_title(title, fontsize=10)
        axis.grid(axis="y", alpha=0.3)
    axes[0].set_yscale("log")
    # Where a round of the hivemind-based paths goes: matchmaking, then the all-reduce.
    axis, width2 = axes[2], 0.35
    for offset, system in enumerate(("hivemind", "p2p_diloco")):
        xs = [i + (offset - 0.5) * width2 for i in range(len(configs))]
        phases = [((by_key.get((v, p, system)) or {}).get("phases_s") or {}) for v, p in configs]
        match = [ph.get("matchmaking_s", 0) for ph in phases]
        reduce_ = [ph.get("allreduce_s", 0) for ph in phases]
        axis.bar(xs, match, width2, color=colors[system], alpha=0.45, label=f"{system}: matchmaking")
        axis.bar(xs, reduce_, width2, bottom=match, color=colors[system], label=f"{system}: all-reduce")
    axis.set_xticks(range(len(configs)), labels, fontsize=9)
    axis.set_title("phases of a round, seconds (mean over peers)", fontsize=10)
    axis.grid(axis="y", alpha=0.3)
    axis.legend(fontsize=8)
    axes[0].legend(fontsize=9)
    fig.suptitle("Averaging a flat fp32 vector on 127.0.0.1 (labels: times gloo's seconds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(rows: list[dict]) -> None:
    print(
        f"{'values':>8} {'peers':>5} {'system':>11} {'s/round':>8} {'GB/s':>6} {'x gloo':>7} {'match':>6} "
        f"{'allred':>6} {'correct':>7}"
    )
    for r in rows:
        p = r.get("phases_s", {})
        seconds = f"{r['seconds']:.3f}" if r.get("seconds") else "fail"
        gbps = f"{r['gb_per_s']:.3f}" if r.get("gb_per_s") else "-"
        ratio = f"{r['ratio_to_gloo']:.1f}" if r.get("ratio_to_gloo") else "-"
        print(
            f"{r['values'] / 1e6:>7g}M {r['peers']:>5} {r['system']:>11} {seconds:>8} {gbps:>6} {ratio:>7} "
            f"{p.get('matchmaking_s', 0):>6.2f} {p.get('allreduce_s', 0):>6.2f} {str(r.get('correct')):>7}"
        )


def main(argv: list[str] | None = None) -> int:
    """Run every configuration and write exchange.json and exchange.png (exchange-smoke.* with --smoke)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="10M values only, 2 and 4 peers")
    parser.add_argument("--smoke", action="store_true", help="1M values, 2 peers, 1 timed round, no profile")
    parser.add_argument("--values", type=int, nargs="+", help="vector sizes (default 10M 50M)")
    parser.add_argument("--peers", type=int, nargs="+", help="group sizes (default 2 4)")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--rounds", type=int, help="timed rounds per configuration (default 2; 3 with --quick)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled p2p_diloco run")
    parser.add_argument("--out", default=str(RESULTS), help="folder for the JSON and the PNG")
    parser.add_argument("--logs", help="keep the peers' logs and profiler output in this folder")
    # worker mode
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--socket-dir", help=argparse.SUPPRESS)
    parser.add_argument("--no-check", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.values, args.peers = args.values[0], args.peers[0]
        return worker(args)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks that stop the workers
    if args.smoke:
        values, peers, rounds = [1_000_000], [2], 1
    elif args.quick:
        values, peers, rounds = [10_000_000], [2, 4], 3
    else:
        values, peers, rounds = [10_000_000, 50_000_000], [2, 4], 2
    values, peers = args.values or values, args.peers or peers
    rounds = args.rounds or rounds
    profile = [] if args.smoke or args.no_profile else [s for s in ("hivemind", "p2p_diloco") if s in args.systems]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    rows = []
    profile_rows = []
    global SOCKET_DIR
    with (
        tempfile.TemporaryDirectory(prefix="exchange-bench-") as tmp,
        tempfile.TemporaryDirectory(prefix="exb-", dir="/tmp") as sockets,
    ):
        SOCKET_DIR = Path(sockets)  # short: a unix socket path must stay under 108 bytes
        logs = Path(args.logs or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        for v in values:
            for p in peers:
                for system in [s for s in SYSTEMS if s in args.systems]:
                    print(f"== {system}: {v / 1e6:g}M values, {p} peers ...", flush=True)
                    row = run_config(system, v, p, warmup=args.warmup, rounds=rounds, logs=logs)
                    rows.append(row)
                    if row.get("seconds"):
                        print(
                            f"   {row['seconds']:.3f} s/round ({row['seconds_per_round']}), "
                            f"{row['gb_per_s']:.3f} GB/s, correct={row['correct']}, wall {row['wall_s']:.0f}s",
                            flush=True,
                        )
        for system in profile:  # separate runs: the profilers' overhead stays out of the rows above
            v, p = min(values), max(peers)
            print(f"== profile: {system} {v / 1e6:g}M values, {p} peers under py-spy and perf ...", flush=True)
            folder = logs / f"profile-{system}"
            folder.mkdir(exist_ok=True)
            profile_rows.append(
                run_config(system, v, p, warmup=args.warmup, rounds=rounds, logs=logs, profile_dir=folder)
            )
    add_ratios(rows)
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": versions(),
        "definitions": {
            "seconds": "median over timed rounds of the slowest peer's time for the round. gloo: barrier, then "
            "all_reduce + divide. hivemind: DecentralizedAverager.step() call to its result (copies in/out "
            "excluded). p2p_diloco: the whole GossipExchange.average() call (copy-in, matchmaking, "
            "all-reduce, clone of the result)",
            "gb_per_s": "values x 4 bytes / seconds / 1e9 (effective, not bytes on the wire)",
            "ratio_to_gloo": "seconds / gloo seconds at the same values and peers (above 1 = slower than gloo)",
            "correct": f"every peer's result within {TOLERANCE} (max abs) of the true mean in every timed round",
            "phases_s": "mean over peers, median over rounds; matchmaking_s = step() call until the stage is "
            "RUNNING_ALLREDUCE (p2p_diloco: includes the copy-in), allreduce_s = from then to the result "
            "(p2p_diloco: includes the clone of the result)",
            "cpu_s_per_round": "CPU seconds of all peers' processes by role (main, averager, dht, p2pd) per "
            "timed round; cpu_busy_fraction = that over wall time x cores",
            "other_load_cpu_s_per_round": "CPU used by other processes on the machine meanwhile",
        },
        "settings": {
            "warmup_rounds": args.warmup,
            "timed_rounds": rounds,
            "min_matchmaking_time": MIN_MATCHMAKING_TIME,
            "request_timeout": REQUEST_TIMEOUT,
            "next_chunk_timeout": NEXT_CHUNK_TIMEOUT,
            "target_group_size": "peers",
            "min_group_size": "peers",
            "compression": "none (fp32)",
            "address": "127.0.0.1",
        },
        "rows": rows,
        "profile": profile_summary(rows, profile_rows),
        "runtime_s": time.monotonic() - started,
    }
    name = "exchange-smoke" if args.smoke else "exchange"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    plot(rows, out / f"{name}.png")
    print()
    print_table(rows)
    print()
    for line in result["profile"]["summary"]:
        print(" - " + line)
    print(f"\nwrote {out / (name + '.json')} and {out / (name + '.png')} in {result['runtime_s']:.0f}s")
    return 0 if all(r.get("correct") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
