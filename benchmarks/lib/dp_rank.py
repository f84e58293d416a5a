"""One rank of the quality benchmark's data-parallel system (`python -m lib.dp_rank` from benchmarks/): gradients
all-reduced every step inside p2p_diloco.diloco.inner.run_inner_steps, rank 0 evaluating every H steps.

This module imports only what training needs, so that the carried-over baseline (lib/quality_carry.py) is voided
by edits to training code, not to the benchmark's reporting.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from lib.quality_common import ISLANDS, load_island_config
from lib.source_digest import loaded_sources


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


def main() -> None:
    """Run one rank from the command line, then exit without interpreter teardown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--rendezvous", required=True, help="a file:// URI for gloo's rendezvous")
    parser.add_argument("--settings", required=True, help="quality.py's settings as JSON")
    parser.add_argument("--metrics", required=True, help="where rank 0 writes its JSON lines")
    args = parser.parse_args()
    code = dp_worker(args.rank, ISLANDS, args.rendezvous, json.loads(args.settings), Path(args.metrics))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown, where gloo's threads can abort() in static destructors


if __name__ == "__main__":
    main()
