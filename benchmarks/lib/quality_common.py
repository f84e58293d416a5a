"""What the quality benchmark's systems share: its island settings as flags and as a PeerConfig, run bounds,
the initial eval loss, and a follower that prints the metrics of running children."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

ISLANDS = 4
SYSTEMS = ("data_parallel", "p2p_diloco", "isolated", "single")


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
        "--eval-every",
        str(settings["eval_every"]),
        "--seed",
        str(settings["seed"]),
        "--lr",
        str(settings["island_lr"]),
        "--outer-lr",
        str(settings["outer_lr"]),
        "--outer-momentum",
        str(settings["outer_momentum"]),
        # Trusted islands measure the algorithm: the plain mean, as in the DiLoCo papers and the reference.
        "--robust-merge",
        "none",
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
        "train.eval_every": settings["eval_every"],
        "train.seed": settings["seed"],
        "train.lr": settings["island_lr"],
        "train.outer_lr": settings["outer_lr"],
        "train.outer_momentum": settings["outer_momentum"],
    }
    return load_config(settings["config"], overrides)


def read_jsonl(path: Path) -> list[dict]:
    """JSON lines of a file (a half-written last line skipped), or [] when it does not exist."""
    from p2p_diloco.train.metrics import read_metrics

    return read_metrics(path) if path.exists() else []


def check_codes(codes: list[int], what: str, logs: list[Path]) -> None:
    """Raise with the logs' tails when any exit code is not 0."""
    if any(codes):
        tails = "\n".join(f"--- {log}:\n{log.read_text()[-2000:]}" for log in logs if log.exists())
        raise RuntimeError(f"{what} failed with exit codes {codes}\n{tails}")


def timeout_for(settings: dict) -> float:
    """Generous bound on one system's run: startup plus 1 s per inner step on a loaded machine."""
    return 240 + 1.0 * settings["outer_steps"] * settings["inner_steps"] * 4


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
                evaluated = "-" if record["eval_loss"] is None else f"{record['eval_loss']:.4f}"
                print(
                    f"  [{name}] outer step {record['outer_step']}/{self.outer_steps}  "
                    f"loss {record['loss']:.4f}  eval {evaluated}"
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
