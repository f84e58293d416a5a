"""Quality vs data-parallel: the same model, data and total tokens trained four ways, eval loss against tokens.

    (a) data_parallel  torch.distributed (gloo), 4 processes, one per shard, gradients all-reduced every step
                       (global batch = 4 x the island batch), the islands' AdamW, warm-up and grad clip, T*H steps
    (b) isolated       4 islands (`p2p-diloco peer --solo true`) on the 4 shards that never communicate;
                       the reported loss is the mean of their final eval losses
    (c) p2p_diloco     a real local swarm: a bootstrap and 4 `p2p-diloco peer` processes, quorum 4, T outer steps
                       of H inner steps
    (d) single         one solo island on shard 0 for the same T*H steps (it sees 1/4 of the total tokens)

Every system starts from the same initial weights (model seed), island / rank i trains on shard i of 4 with the
island's batch-order seed, and every eval uses the same held-out tail of the corpus. The systems run one after
the other so that they do not compete for the CPU.

    python benchmarks/quality.py            # full run (default model, T=72, H=5; about 6 minutes on 2 cores)
    python benchmarks/quality.py --quick    # default model, T=24, H=5 (2 minutes)
    python benchmarks/quality.py --smoke    # tiny model, T=3, H=5 (used by the tests)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from common import machine

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
TINY = REPO / "peers" / "tiny.toml"
ISLANDS = 4
SYSTEMS = ("data_parallel", "p2p_diloco", "isolated", "single")
CLI_MODE = "--p2p-diloco-cli"  # internal: run the p2p-diloco command with a private hivemind socket folder

# mode: (outer steps T, inner steps H, eval batches, tiny model)
MODES = {
    "full": (72, 5, 8, False),
    "quick": (24, 5, 8, False),
    "smoke": (3, 5, 2, True),
}
# At this budget (360 inner steps) outer Nesterov momentum hurts: a sweep with the single-process reference
# (tests/test_swarm.py::reference_diloco, 4 islands, same data) gave final eval loss 2.354 (H=30, lr 0.7,
# momentum 0.9), 2.446 (H=10), 2.642 (H=5); with outer lr 1.0 and no momentum 2.108 (H=30), 1.925 (H=10),
# 1.847 (H=5); H=5 with momentum 0.3: 2.163, lr 0.5 momentum 0.9: 2.497. The benchmark uses the best.
OUTER_LR, OUTER_MOMENTUM = 1.0, 0.0


def peer_config_args(settings: dict) -> list[str]:
    """Config flags shared by every island, every solo run and every data-parallel rank."""
    args = [
        "--num-shards",
        str(ISLANDS),
        "--outer-steps",
        str(settings["outer_steps"]),
        "--inner-steps",
        str(settings["inner_steps"]),
        "--eval-batches",
        str(settings["eval_batches"]),
        "--seed",
        str(settings["seed"]),
        "--outer-lr",
        str(settings["outer_lr"]),
        "--outer-momentum",
        str(settings["outer_momentum"]),
    ]
    if settings["config"]:
        args = ["--config", settings["config"], *args]
    return args


def load_island_config(settings: dict, shard_index: int):
    """The PeerConfig an island of this benchmark trains with (the data-parallel ranks use it too)."""
    from p2p_diloco.config import load_config

    overrides = {
        "data.num_shards": ISLANDS,
        "data.shard_index": shard_index,
        "train.outer_steps": settings["outer_steps"],
        "train.inner_steps": settings["inner_steps"],
        "data.eval_batches": settings["eval_batches"],
        "train.seed": settings["seed"],
        "train.outer_lr": settings["outer_lr"],
        "train.outer_momentum": settings["outer_momentum"],
    }
    return load_config(settings["config"], overrides)


# ----- (a) data-parallel worker -----------------------------------------------------------------------------------
def dp_worker(rank: int, world: int, rendezvous: str, settings: dict, metrics_path: Path) -> int:
    """One rank of synchronous data-parallel training; rank 0 evaluates every H steps and writes JSON lines."""
    import torch
    import torch.distributed as dist

    from p2p_diloco.diloco.outer import make_inner_optimizer
    from p2p_diloco.island.island import data_seed
    from p2p_diloco.train.data import BatchStream, evaluate, load_shards
    from p2p_diloco.train.model import build_model

    torch.set_num_threads(1)
    config = load_island_config(settings, rank)
    train = config.train
    dist.init_process_group(
        "gloo",
        init_method=rendezvous,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    try:
        shards = load_shards(config.data)
        model = build_model(config.model, seed=train.seed)
        optimizer, scheduler = make_inner_optimizer(model, train.lr, train.weight_decay, train.warmup_steps)
        # The same batches island `rank` would draw: its shard and its batch-order seed
        stream = BatchStream(
            shards.train_shard(rank, world),
            train.batch_size,
            config.model.seq_len,
            seed=data_seed(train.seed, rank, ""),
        )
        params = list(model.parameters())
        sizes = [p.numel() for p in params]
        total_steps = train.outer_steps * train.inner_steps
        tokens_per_step = world * stream.tokens_per_batch
        losses: list[float] = []
        started = time.monotonic()
        with open(metrics_path, "w") if rank == 0 else open(os.devnull, "w") as metrics:
            for step in range(1, total_steps + 1):
                inputs, targets = stream.next_batch()
                _, loss = model(inputs, targets)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                # One all-reduce per step of every gradient plus the loss: the mean over the 4 x batch
                flat = torch.cat(
                    [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
                    + [loss.detach().reshape(1)]
                )
                dist.all_reduce(flat)
                flat /= world
                for param, grad in zip(params, flat[:-1].split(sizes)):
                    param.grad = grad.view_as(param).clone()
                if train.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(params, train.grad_clip)
                optimizer.step()
                scheduler.step()
                losses.append(flat[-1].item())
                if step % train.inner_steps == 0 and rank == 0:
                    eval_loss = evaluate(
                        model, shards.eval, config.model.seq_len, train.batch_size, config.data.eval_batches
                    )
                    record = {
                        "step": step,
                        "outer_step": step // train.inner_steps,
                        "tokens": step * tokens_per_step,
                        "loss": sum(losses[-train.inner_steps :]) / train.inner_steps,
                        "eval_loss": eval_loss,
                        "elapsed_s": time.monotonic() - started,
                    }
                    metrics.write(json.dumps(record) + "\n")
                    metrics.flush()
                    print(
                        f"[data_parallel] step {step}/{total_steps}  loss {record['loss']:.4f}  eval {eval_loss:.4f}",
                        flush=True,
                    )
            # Every rank must hold the same weights: the spread across ranks of every parameter is zero
            vector = torch.cat([p.detach().reshape(-1) for p in params])
            high, low = vector.clone(), vector.clone()
            dist.all_reduce(high, op=dist.ReduceOp.MAX)
            dist.all_reduce(low, op=dist.ReduceOp.MIN)
            spread = (high - low).abs().max().item()
            if rank == 0:
                metrics.write(json.dumps({"replica_max_abs_diff": spread}) + "\n")
        dist.barrier()  # no rank tears down while another still talks to it
        return 0
    finally:
        dist.destroy_process_group()


# ----- process helpers --------------------------------------------------------------------------------------------
def _child_setup() -> None:
    from p2p_diloco.process import die_with_parent

    die_with_parent(signal.SIGTERM)


def read_jsonl(path: Path) -> list[dict]:
    """JSON lines of a file (a half-written last line skipped), or [] when it does not exist."""
    from p2p_diloco.train.metrics import read_metrics

    return read_metrics(path) if path.exists() else []


def _check_codes(codes: list[int], what: str, logs: list[Path]) -> None:
    if any(codes):
        tails = "\n".join(f"--- {log}:\n{log.read_text()[-2000:]}" for log in logs if log.exists())
        raise RuntimeError(f"{what} failed with exit codes {codes}\n{tails}")


def timeout_for(settings: dict) -> float:
    """Generous bound on one system's run: startup plus 1 s per inner step on a loaded machine."""
    return 240 + 1.0 * settings["outer_steps"] * settings["inner_steps"] * 4


# ----- the four systems -------------------------------------------------------------------------------------------
def run_data_parallel(settings: dict, folder: Path) -> dict:
    """(a): 4 gloo ranks of this file in --dp-worker mode."""
    folder.mkdir(parents=True, exist_ok=True)
    metrics = folder / "rank-0.jsonl"
    metrics.unlink(missing_ok=True)
    # A file rendezvous needs no free port (a port picked here could be taken before rank 0 binds it)
    store = folder / "rendezvous"
    store.unlink(missing_ok=True)
    settings_json = json.dumps(settings)
    children: list[subprocess.Popen] = []
    logs = [folder / f"rank-{rank}.log" for rank in range(ISLANDS)]
    started = time.monotonic()
    try:
        for rank in range(ISLANDS):
            command = [sys.executable, str(Path(__file__).resolve()), "--dp-worker", str(rank)]
            command += ["--dp-rendezvous", store.resolve().as_uri(), "--dp-settings", settings_json]
            command += ["--dp-metrics", str(metrics)]
            with open(logs[rank], "w") as log:
                children.append(
                    subprocess.Popen(
                        command,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        preexec_fn=_child_setup,
                    )
                )
        progress = Progress({"data_parallel": metrics}, settings["outer_steps"])
        codes = progress.follow(children, timeout_for(settings), "data-parallel training")
    finally:
        _stop_all(children)
        store.unlink(missing_ok=True)
    wall = time.monotonic() - started
    records = read_jsonl(metrics)
    finished = any("replica_max_abs_diff" in r for r in records)
    if not finished:  # a rank that fails after the last all-reduce (teardown) does not void the results
        _check_codes(codes, "data-parallel training", logs)
    if any(codes):
        print(f"  warning: data-parallel ranks exited with {codes} after finishing training", flush=True)
    evals = [r for r in records if "eval_loss" in r]
    spread = next((r["replica_max_abs_diff"] for r in records if "replica_max_abs_diff" in r), None)
    return {
        "curve": {
            "tokens": [r["tokens"] for r in evals],
            "eval_loss": [r["eval_loss"] for r in evals],
            "inner_steps": [r["step"] for r in evals],
        },
        "final_eval_loss": evals[-1]["eval_loss"],
        "total_tokens": evals[-1]["tokens"],
        "steps": evals[-1]["step"],
        "replica_max_abs_diff": spread,
        "exit_codes": codes,
        "wall_s": wall,
    }


def _stop_all(children: list[subprocess.Popen]) -> None:
    from p2p_diloco.cli.swarm import stop

    for child in children:
        stop(child, grace=10)


class Progress:
    """Prints new metrics lines of running children while waiting for them to finish."""

    def __init__(self, files: dict[str, Path], outer_steps: int, check: Callable[[dict], None] | None = None):
        self.files, self.outer_steps, self.check = files, outer_steps, check
        self.seen = {name: 0 for name in files}

    def poll(self) -> None:
        for name, path in self.files.items():
            if name == "data_parallel":  # the rank prints its own progress into its log; mirror its lines
                records = [r for r in read_jsonl(path) if "eval_loss" in r]
            else:
                records = read_jsonl(path)
            for record in records[self.seen[name] :]:
                print(
                    f"  [{name}] outer step {record['outer_step']}/{self.outer_steps}  "
                    f"loss {record['loss']:.4f}  eval {record['eval_loss']:.4f}"
                    + (f"  partners {record['partners']}" if "partners" in record else ""),
                    flush=True,
                )
                if self.check is not None:
                    self.check(record)
            self.seen[name] = len(records)

    def follow(self, children: list[subprocess.Popen], timeout: float, what: str) -> list[int]:
        deadline = time.monotonic() + timeout
        while any(child.poll() is None for child in children):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not finish within {timeout:.0f}s")
            self.poll()
            time.sleep(1.0)  # progress display cadence, not synchronisation
        self.poll()
        return [child.returncode for child in children]


def _island_curve(records_by_island: list[list[dict]]) -> dict:
    """System curve of islands that step in lockstep: tokens summed over islands, eval loss averaged."""
    steps = min(len(records) for records in records_by_island)
    curve = {"tokens": [], "eval_loss": [], "inner_steps": [], "eval_loss_spread": []}
    for index in range(steps):
        rows = [records[index] for records in records_by_island]
        losses = [row["eval_loss"] for row in rows]
        curve["tokens"].append(sum(row["tokens"] for row in rows))
        curve["eval_loss"].append(sum(losses) / len(losses))
        curve["inner_steps"].append(rows[0]["inner_steps_total"])
        curve["eval_loss_spread"].append(max(losses) - min(losses))
    return curve


class BrokenRound(RuntimeError):
    """A p2p round that did not average all four islands: the run no longer measures p2p-diloco."""


def spawn_cli(args: list[str], sockets: str, **kwargs) -> subprocess.Popen:
    """Start `p2p-diloco ARGS` (as p2p_diloco.cli.swarm.spawn does) with hivemind's unix sockets under `sockets`."""
    command = [sys.executable, str(Path(__file__).resolve()), CLI_MODE, sockets, *args]
    return subprocess.Popen(command, start_new_session=True, preexec_fn=_child_setup, **kwargs)


def run_cli(sockets: str, args: list[str]) -> int:
    """The `p2p-diloco` command, with hivemind's daemon sockets in a folder of this benchmark's own.

    hivemind puts them in /tmp, where the test suite's no_leftover_daemons fixture unlinks every new
    hivemind-*.sock, live or not: a test session running meanwhile on the same machine would cut the islands
    off from their p2pd daemons and every later round would fail.
    """
    from hivemind.p2p import P2P

    from p2p_diloco.cli.main import main as cli_main

    P2P._UNIX_SOCKET_PREFIX = f"/unix{sockets}/hivemind-"  # inherited by the forked DHT and averager processes
    return cli_main(args)


def start_bootstrap(folder: Path, run_id: str, sockets: str) -> tuple[subprocess.Popen, list[str]]:
    """p2p_diloco.cli.swarm.start_bootstrap with the private socket folder: the bootstrap and its multiaddrs."""
    from p2p_diloco.cli.swarm import read_bootstrap_maddrs

    args = ["bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--run-id", run_id]
    args += ["--maddrs-file", str(folder / "bootstrap.maddrs")]
    process = spawn_cli(args, sockets, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return process, read_bootstrap_maddrs(process)


def _every_island_merged(record: dict) -> None:
    if record["partners"] != ISLANDS - 1:
        raise BrokenRound(
            f"outer step {record['outer_step']} of {record['peer_id'][:16]} averaged with {record['partners']} "
            f"of {ISLANDS - 1} islands ({record.get('note')})"
        )


def run_p2p(settings: dict, folder: Path, attempts: int = 3) -> dict:
    """(c): a bootstrap and 4 peers with quorum 4, so every round averages all four islands.

    A round without all four islands (a failed all-reduce) stops the run, which is started again from scratch,
    at most `attempts` times: the comparison is meant for p2p-diloco that works, and the failures are recorded.
    """
    failures = []
    for attempt in range(1, attempts + 1):
        sockets = tempfile.mkdtemp(prefix="quality-", dir="/tmp")  # short: a unix socket path has < 108 bytes
        try:
            result = _p2p_attempt(settings, folder, sockets)
        except BrokenRound as error:
            failures.append(str(error))
            print(f"  attempt {attempt} of {attempts}: {error}; starting the swarm again", flush=True)
            continue
        finally:
            shutil.rmtree(sockets, ignore_errors=True)
        result["failed_attempts"] = failures
        return result
    raise RuntimeError(f"the p2p-diloco swarm failed {attempts} times: {failures}")


def _p2p_attempt(settings: dict, folder: Path, sockets: str) -> dict:
    from p2p_diloco.cli.swarm import stop

    folder.mkdir(parents=True, exist_ok=True)
    run_id = "quality"
    metrics = {f"island-{i}": folder / f"island-{i}.jsonl" for i in range(ISLANDS)}
    logs = [folder / f"island-{i}.log" for i in range(ISLANDS)]
    for path in metrics.values():
        path.unlink(missing_ok=True)
    children: list[subprocess.Popen] = []
    started = time.monotonic()
    bootstrap, maddrs = start_bootstrap(folder, run_id, sockets)
    try:
        for index in range(ISLANDS):
            args = ["peer", "--initial-peers", *maddrs, "--run-id", run_id, "--shard-index", str(index)]
            args += ["--metrics", str(metrics[f"island-{index}"]), *peer_config_args(settings)]
            args += ["--target-group-size", str(ISLANDS), "--quorum", str(ISLANDS), "--averaging-timeout", "120"]
            args += ["--join-timeout", "120"]  # a loaded machine can be slow to start the DHT
            with open(logs[index], "w") as log:
                children.append(spawn_cli(args, sockets, stdout=log, stderr=subprocess.STDOUT))
        progress = Progress(metrics, settings["outer_steps"], check=_every_island_merged)
        codes = progress.follow(children, timeout_for(settings), "the swarm")
    finally:
        _stop_all(children)
        stop(bootstrap, grace=10)
    wall = time.monotonic() - started
    _check_codes(codes, "the p2p-diloco swarm", logs)
    records = [read_jsonl(path) for path in metrics.values()]
    curve = _island_curve(records)
    partners = [r["partners"] for island in records for r in island]
    digests_agree = all(len({island[k]["anchor_digest"] for island in records}) == 1 for k in range(len(records[0])))
    return {
        "curve": curve,
        "final_eval_loss": curve["eval_loss"][-1],
        "final_eval_loss_per_island": [island[-1]["eval_loss"] for island in records],
        "total_tokens": curve["tokens"][-1],
        "steps": curve["inner_steps"][-1],
        "mean_partners": sum(partners) / len(partners),
        "rounds_with_all_islands": sum(p == ISLANDS - 1 for p in partners) / len(partners),
        "anchor_digests_agree": digests_agree,
        "mean_wait_s": sum(r["wait_s"] for island in records for r in island) / len(partners),
        "wall_s": wall,
    }


def run_solo(settings: dict, folder: Path) -> tuple[dict, dict]:
    """(b) and (d): 4 solo islands on the 4 shards plus one more solo island on shard 0, run side by side."""
    from p2p_diloco.cli.swarm import spawn

    folder.mkdir(parents=True, exist_ok=True)
    runs = {f"isolated-{i}": i for i in range(ISLANDS)} | {"single": 0}
    metrics = {name: folder / f"{name}.jsonl" for name in runs}
    logs = [folder / f"{name}.log" for name in runs]
    for path in metrics.values():
        path.unlink(missing_ok=True)
    children: list[subprocess.Popen] = []
    started = time.monotonic()
    try:
        for name, shard in runs.items():
            args = ["peer", "--solo", "true", "--run-id", f"quality-{name}", "--shard-index", str(shard)]
            args += ["--metrics", str(metrics[name]), *peer_config_args(settings)]
            children.append(spawn(args, log_path=folder / f"{name}.log"))
        codes = Progress(metrics, settings["outer_steps"]).follow(
            children, timeout_for(settings) * 1.5, "the solo islands"
        )
    finally:
        _stop_all(children)
    wall = time.monotonic() - started
    _check_codes(codes, "the solo islands", logs)
    records = {name: read_jsonl(path) for name, path in metrics.items()}
    isolated_records = [records[f"isolated-{i}"] for i in range(ISLANDS)]
    curve = _island_curve(isolated_records)
    finals = [island[-1]["eval_loss"] for island in isolated_records]
    isolated = {
        "curve": curve,
        "final_eval_loss": sum(finals) / len(finals),
        "final_eval_loss_per_island": finals,
        "total_tokens": curve["tokens"][-1],
        "steps": curve["inner_steps"][-1],
        "wall_s": wall,
        "note": "4 islands with --solo true (each applies its own outer Nesterov step); loss = mean over islands",
    }
    single_records = records["single"]
    single = {
        "curve": {
            "tokens": [r["tokens"] for r in single_records],
            "eval_loss": [r["eval_loss"] for r in single_records],
            "inner_steps": [r["inner_steps_total"] for r in single_records],
        },
        "final_eval_loss": single_records[-1]["eval_loss"],
        "total_tokens": single_records[-1]["tokens"],
        "steps": single_records[-1]["inner_steps_total"],
        "wall_s": wall,
        "identical_to_isolated_island_0": [r["anchor_digest"] for r in single_records]
        == [r["anchor_digest"] for r in isolated_records[0]],
        "note": (
            "one solo island on shard 0 for the same T*H steps: it trains on 1/4 of the total tokens of the "
            "other systems; same shard, seed and steps as isolated island 0"
        ),
    }
    return isolated, single


def initial_eval(settings: dict) -> float:
    """Eval loss of the shared initial weights: the first point of every curve."""
    import torch

    from p2p_diloco.train.data import evaluate, load_shards
    from p2p_diloco.train.model import build_model

    config = load_island_config(settings, 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model(config.model, seed=config.train.seed)
        shards = load_shards(config.data)
        return evaluate(model, shards.eval, config.model.seq_len, config.train.batch_size, config.data.eval_batches)
    finally:
        torch.set_num_threads(threads)


# ----- report -----------------------------------------------------------------------------------------------------
LABELS = {
    "data_parallel": "data-parallel (gloo, 4 ranks, 4x batch)",
    "p2p_diloco": "p2p-diloco (4 islands)",
    "isolated": "4 isolated islands (mean)",
    "single": "one island alone (1/4 of the tokens)",
}


def plot(results: dict, path: Path, title: str) -> None:
    """One axes: eval loss against the tokens each system processed, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(8, 5))
    styles = {"data_parallel": "-", "p2p_diloco": "-", "isolated": "--", "single": ":"}
    for name in SYSTEMS:
        curve = results["curves"][name]
        axis.plot(curve["tokens"], curve["eval_loss"], styles[name], marker="o", markersize=3, label=LABELS[name])
    curves = [results["curves"][name]["eval_loss"] for name in SYSTEMS]
    after_first = [losses[1] for losses in curves if len(losses) > 1]
    finals = list(results["final_eval_loss"].values())
    if after_first:
        axis.set_ylim(min(finals) - 0.05 * (max(after_first) - min(finals)), max(after_first) * 1.02)
    axis.set_xlabel("tokens processed by the system (summed over its workers)")
    axis.set_ylabel("eval loss (held-out tail, nats/byte)")
    axis.set_title(title, fontsize=10)
    axis.grid(alpha=0.3)
    axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(results: dict) -> str:
    """The final numbers as a text table."""
    dp = results["final_eval_loss"]["data_parallel"]
    lines = [f"{'system':<16}{'final eval':>12}{'vs DP':>9}{'tokens':>12}{'steps/worker':>14}{'wall s':>9}"]
    for name in SYSTEMS:
        row = results["systems"][name]
        loss = results["final_eval_loss"][name]
        lines.append(
            f"{name:<16}{loss:>12.4f}{loss / dp - 1:>+9.2%}{row['total_tokens']:>12,}{row['steps']:>14}"
            f"{row['wall_s']:>9.0f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the four systems one after the other and write quality.json and quality.png."""
    argv_list = sys.argv[1:] if argv is None else argv
    if argv_list[:1] == [CLI_MODE]:
        return run_cli(argv_list[1], argv_list[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="default model, fewer steps (a minute or two)")
    parser.add_argument("--smoke", action="store_true", help="tiny model, a few steps (used by the tests)")
    parser.add_argument("--outer-steps", type=int, help="T: outer steps (data-parallel runs T*H steps)")
    parser.add_argument("--inner-steps", type=int, help="H: inner steps per outer step")
    parser.add_argument("--eval-batches", type=int, help="batches of the held-out tail per evaluation")
    parser.add_argument("--seed", type=int, default=0, help="model-init and batch-order seed")
    parser.add_argument("--outer-lr", type=float, default=OUTER_LR, help="outer learning rate of every island")
    parser.add_argument("--outer-momentum", type=float, default=OUTER_MOMENTUM, help="outer Nesterov momentum")
    parser.add_argument("--config", help="peer TOML config (default: p2p_diloco defaults; --smoke: peers/tiny.toml)")
    parser.add_argument("--out", default=str(RESULTS), help="folder for the JSON, the PNG and run logs")
    # internal: one data-parallel rank
    parser.add_argument("--dp-worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dp-rendezvous", help=argparse.SUPPRESS)
    parser.add_argument("--dp-settings", help=argparse.SUPPRESS)
    parser.add_argument("--dp-metrics", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dp_worker is not None:
        settings = json.loads(args.dp_settings)
        code = dp_worker(args.dp_worker, ISLANDS, args.dp_rendezvous, settings, Path(args.dp_metrics))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip interpreter teardown, where gloo's threads can abort() in static destructors

    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    outer_steps, inner_steps, eval_batches, tiny = MODES[mode]
    settings = {
        "mode": mode,
        "outer_steps": args.outer_steps or outer_steps,
        "inner_steps": args.inner_steps or inner_steps,
        "eval_batches": args.eval_batches or eval_batches,
        "seed": args.seed,
        "outer_lr": args.outer_lr,
        "outer_momentum": args.outer_momentum,
        "config": args.config or (str(TINY) if tiny else None),
    }
    out = Path(args.out)
    runs = out / "quality-runs"
    out.mkdir(parents=True, exist_ok=True)
    config = load_island_config(settings, 0)
    batch, seq_len = config.train.batch_size, config.model.seq_len
    print(
        f"quality ({mode}): T={settings['outer_steps']} outer x H={settings['inner_steps']} inner steps, "
        f"{ISLANDS} islands, batch {batch} x {seq_len} tokens, config {settings['config'] or 'defaults'}",
        flush=True,
    )
    started = time.monotonic()
    start_eval = initial_eval(settings)
    systems: dict[str, dict] = {}
    print("== (a) data-parallel: 4 gloo ranks ...", flush=True)
    systems["data_parallel"] = run_data_parallel(settings, runs / "data-parallel")
    print("== (c) p2p-diloco: bootstrap + 4 islands, quorum 4 ...", flush=True)
    systems["p2p_diloco"] = run_p2p(settings, runs / "p2p")
    print("== (b) + (d) 4 isolated islands and one island alone ...", flush=True)
    systems["isolated"], systems["single"] = run_solo(settings, runs / "solo")
    systems = {name: systems[name] for name in SYSTEMS}

    curves = {}
    for name, row in systems.items():
        curve = row.pop("curve")
        curves[name] = {
            "tokens": [0, *curve["tokens"]],
            "eval_loss": [start_eval, *curve["eval_loss"]],
            "inner_steps_per_worker": [0, *curve["inner_steps"]],
        }
        if "eval_loss_spread" in curve:
            curves[name]["eval_loss_spread_over_islands"] = [0.0, *curve["eval_loss_spread"]]
    final = {name: systems[name]["final_eval_loss"] for name in SYSTEMS}
    ratio = final["p2p_diloco"] / final["data_parallel"]
    result = {
        "final_eval_loss": final,
        "p2p_vs_dp_ratio": ratio,
        "targets": {
            "p2p_within_2pct_of_dp": ratio <= 1.02,
            "p2p_below_isolated": final["p2p_diloco"] < final["isolated"],
            "p2p_minus_isolated": final["p2p_diloco"] - final["isolated"],
        },
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "settings": {
            **settings,
            "islands": ISLANDS,
            "num_shards": ISLANDS,
            "batch_size_per_worker": batch,
            "seq_len": seq_len,
            "dp_global_batch": ISLANDS * batch,
            "dp_steps": settings["outer_steps"] * settings["inner_steps"],
            "tokens_per_system": ISLANDS * settings["outer_steps"] * settings["inner_steps"] * batch * seq_len,
            "model": config.model.__dict__,
            "train": {
                key: getattr(config.train, key)
                for key in ("lr", "weight_decay", "warmup_steps", "grad_clip", "outer_lr", "outer_momentum")
            },
            "initial_eval_loss": start_eval,
        },
        "notes": {
            "tokens": "x = tokens processed by the whole system (data-parallel and p2p-diloco: summed over 4 workers)",
            "single": "the single island sees 1/4 of the total tokens of the other systems",
            "data_parallel": "gradients averaged with all_reduce every step, then clipped; AdamW and warm-up as "
            "make_inner_optimizer; rank r draws island r's batches (its shard and batch-order seed)",
        },
        "systems": systems,
        "curves": curves,
        "wall_s": time.monotonic() - started,
    }
    name = "quality-smoke" if args.smoke else "quality"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    title = (
        f"Quality vs data-parallel ({mode}): 4 workers, T={settings['outer_steps']}, H={settings['inner_steps']}, "
        f"{result['settings']['tokens_per_system']:,} tokens per system"
    )
    plot(result, out / f"{name}.png", title)
    print()
    print(table(result))
    print(
        f"\np2p/dp final eval loss ratio {ratio:.4f} (target <= 1.02: {'met' if ratio <= 1.02 else 'missed'}); "
        f"p2p - isolated {final['p2p_diloco'] - final['isolated']:+.4f}"
    )
    print(f"total wall time {result['wall_s']:.0f}s; wrote {out / (name + '.json')} and {out / (name + '.png')}")
    return 0 if all(math.isfinite(v) for v in final.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
