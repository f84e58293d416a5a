"""The quality benchmark's data-parallel system: 4 gloo ranks (`quality.py --dp-worker RANK`), gradients
all-reduced every step inside p2p_diloco.diloco.inner.run_inner_steps, rank 0 evaluating every H steps."""

from __future__ import annotations

import datetime
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from lib.common import BENCHMARKS
from lib.quality_carry import loaded_sources, source_digest
from lib.quality_common import ISLANDS, Progress, check_codes, load_island_config, read_jsonl, timeout_for

SCRIPT = BENCHMARKS / "quality.py"
"""The benchmark script; `--dp-worker RANK` runs one rank."""


def gradient_all_reduce(model: Any, world: int) -> Callable[[Any], Any]:
    """An `after_backward` hook: replace every gradient by its mean over the ranks; returns the mean loss.

    One all-reduce per step of every gradient plus the loss: the mean over the 4 x batch.
    """
    import torch
    import torch.distributed as dist

    params = list(model.parameters())
    sizes = [p.numel() for p in params]

    def after_backward(loss: torch.Tensor) -> torch.Tensor:
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
            + [loss.detach().reshape(1)]
        )
        dist.all_reduce(flat)
        flat /= world
        for param, grad in zip(params, flat[:-1].split(sizes)):
            param.grad = grad.view_as(param).clone()
        return flat[-1]

    return after_backward


def train_rank(rank: int, world: int, config: Any, metrics: IO[str]) -> Any:
    """T outer steps of H synchronous steps each; rank 0 writes a record after every H steps. The model."""
    from p2p_diloco.diloco.inner import make_inner_optimizer, run_inner_steps
    from p2p_diloco.train.data import BatchStream, data_seed, evaluate, load_shards
    from p2p_diloco.train.model import build_model

    train = config.train
    shards = load_shards(config.data)
    model = build_model(config.model, seed=train.seed)
    optimizer, scheduler = make_inner_optimizer(model, train.lr, train.weight_decay, train.warmup_steps)
    # The same batches island `rank` would draw: its shard and its batch-order seed
    stream = BatchStream(
        shards.train_shard(rank, world), train.batch_size, config.model.seq_len, seed=data_seed(train.seed, rank, "")
    )
    hook = gradient_all_reduce(model, world)
    total_steps = train.outer_steps * train.inner_steps
    tokens_per_step = world * stream.tokens_per_batch
    started = time.monotonic()
    for outer_step in range(1, train.outer_steps + 1):
        losses = run_inner_steps(
            model,
            optimizer,
            scheduler,
            stream.next_batch,
            train.inner_steps,
            grad_clip=train.grad_clip,
            after_backward=hook,
        ).losses
        if rank != 0 or (outer_step % train.eval_every and outer_step < train.outer_steps):
            continue  # rank 0 evaluates when the islands do: every eval_every outer steps and at the last
        step = outer_step * train.inner_steps
        eval_loss = evaluate(model, shards.eval, config.model.seq_len, train.batch_size, config.data.eval_batches)
        record = {
            "step": step,
            "outer_step": outer_step,
            "tokens": step * tokens_per_step,
            "loss": sum(losses) / train.inner_steps,
            "eval_loss": eval_loss,
            "elapsed_s": time.monotonic() - started,
        }
        metrics.write(json.dumps(record) + "\n")
        metrics.flush()
        print(f"[data_parallel] step {step}/{total_steps}  loss {record['loss']:.4f}  eval {eval_loss:.4f}", flush=True)
    return model


def replica_spread(model: Any) -> float:
    """The largest spread across ranks of any parameter value (0 when every rank holds the same weights)."""
    import torch
    import torch.distributed as dist

    vector = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    high, low = vector.clone(), vector.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return (high - low).abs().max().item()


def dp_worker(rank: int, world: int, rendezvous: str, settings: dict, metrics_path: Path) -> int:
    """One rank of synchronous data-parallel training; rank 0 evaluates every H steps and writes JSON lines."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    config = load_island_config(settings, rank)
    config.train.lr = settings["dp_lr"]  # each system trains at the inner lr tuned for it
    dist.init_process_group(
        "gloo",
        init_method=rendezvous,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    try:
        with open(metrics_path, "w") if rank == 0 else open(os.devnull, "w") as metrics:
            model = train_rank(rank, world, config, metrics)
            # Every rank must hold the same weights: the spread across ranks of every parameter is zero
            spread = replica_spread(model)
            if rank == 0:  # and what the run depends on: quality_carry.py carries it over while they are unchanged
                metrics.write(json.dumps({"replica_max_abs_diff": spread, "sources": loaded_sources()}) + "\n")
        dist.barrier()  # no rank tears down while another still talks to it
        return 0
    finally:
        dist.destroy_process_group()


def _start_ranks(
    settings: dict, store: Path, metrics: Path, logs: list[Path], children: list[subprocess.Popen]
) -> None:
    """Start the ranks into `children`, each in its own session and dying with this process."""
    from p2p_diloco.process import die_with_parent

    for rank in range(ISLANDS):
        command = [sys.executable, str(SCRIPT), "--dp-worker", str(rank)]
        command += ["--dp-rendezvous", store.resolve().as_uri(), "--dp-settings", json.dumps(settings)]
        command += ["--dp-metrics", str(metrics)]
        with open(logs[rank], "w") as log:
            children.append(
                subprocess.Popen(
                    command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=functools.partial(die_with_parent, signal.SIGTERM),
                )
            )


def run_data_parallel(settings: dict, folder: Path) -> dict:
    """(a): 4 gloo ranks of quality.py in --dp-worker mode."""
    from p2p_diloco.cli.launcher import stop

    folder.mkdir(parents=True, exist_ok=True)
    metrics = folder / "rank-0.jsonl"
    metrics.unlink(missing_ok=True)
    # A file rendezvous needs no free port (a port picked here could be taken before rank 0 binds it)
    store = folder / "rendezvous"
    store.unlink(missing_ok=True)
    logs = [folder / f"rank-{rank}.log" for rank in range(ISLANDS)]
    children: list[subprocess.Popen] = []
    started = time.monotonic()
    try:
        _start_ranks(settings, store, metrics, logs, children)
        progress = Progress({"data_parallel": metrics}, settings["outer_steps"])
        codes = progress.follow(children, timeout_for(settings), "data-parallel training")
    finally:
        for child in children:
            stop(child, grace=10)
        store.unlink(missing_ok=True)
    wall = time.monotonic() - started
    records = read_jsonl(metrics)
    finished = any("replica_max_abs_diff" in r for r in records)
    if not finished:  # a rank that fails after the last all-reduce (teardown) does not void the results
        check_codes(codes, "data-parallel training", logs)
    if any(codes):
        print(f"  warning: data-parallel ranks exited with {codes} after finishing training", flush=True)
    evals = [r for r in records if "eval_loss" in r]
    last = next((r for r in records if "replica_max_abs_diff" in r), {})
    sources = last.get("sources", [])
    return {
        "curve": {
            "tokens": [r["tokens"] for r in evals],
            "eval_loss": [r["eval_loss"] for r in evals],
            "inner_steps": [r["step"] for r in evals],
        },
        "final_eval_loss": evals[-1]["eval_loss"],
        "total_tokens": evals[-1]["tokens"],
        "steps": evals[-1]["step"],
        "replica_max_abs_diff": last.get("replica_max_abs_diff"),
        "exit_codes": codes,
        "wall_s": wall,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "sources": sources,
        "source_digest": source_digest(sources) if sources else None,
    }
