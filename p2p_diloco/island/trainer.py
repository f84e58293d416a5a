"""An island's local training: the model, its inner AdamW and schedule, its batches, and the held-out eval."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from p2p_diloco.config import PeerConfig
from p2p_diloco.diloco.fragments import Fragment
from p2p_diloco.diloco.inner import InnerResult, make_inner_optimizer, run_inner_steps
from p2p_diloco.diloco.outer import assign_parameters_, flatten_parameters
from p2p_diloco.train.data import BatchStream, Shards, data_seed, evaluate
from p2p_diloco.train.model import build_model, model_fingerprint


def run_fingerprint(model: torch.nn.Module, config: PeerConfig) -> str:
    """Identifies what islands must share: parameter names and shapes, the model config, the exchange schema."""
    schema = "rda" if config.network.merge == "rda" else "flat"
    text = model_fingerprint(model) + json.dumps(asdict(config.model), sort_keys=True) + schema
    return f"{zlib.crc32(text.encode()):08x}{model_fingerprint(model)[:8]}"


class LocalTrainer:
    """Runs inner steps on this island's shard and moves weights in and out of the model as flat vectors."""

    def __init__(self, config: PeerConfig, shards: Shards):
        self.config = config
        self.shards = shards
        self.model = build_model(config.model, seed=config.train.seed)
        train = config.train
        self.optimizer, self.scheduler = make_inner_optimizer(
            self.model, train.lr, train.weight_decay, train.warmup_steps
        )
        self.stream: BatchStream | None = None
        self.inner_steps_total = 0
        self.tokens = 0
        self.step_time_s: float | None = None
        """Seconds per inner step in the last round (announced for dynamic local updates)."""

    def open_stream(self, peer_id: str) -> None:
        """Start this island's batch stream: its shard, in an order seeded by the shard (or the peer id)."""
        config = self.config
        data = config.data
        tokens = (
            self.shards.train_shard(data.shard_index or 0, data.num_shards)
            if data.shard_index is not None
            else self.shards.train
        )
        seed = data_seed(config.train.seed, data.shard_index, peer_id)
        self.stream = BatchStream(tokens, config.train.batch_size, config.model.seq_len, seed=seed)

    @property
    def tensor_sizes(self) -> list[int]:
        """Element counts of the parameters, in module order."""
        return [parameter.numel() for parameter in self.model.parameters()]

    def train(self, steps: int, should_stop: Callable[[], bool] | None = None) -> InnerResult:
        """Run `steps` inner steps (none for 0; fewer when `should_stop()` says so) and count them."""
        if steps <= 0:
            return InnerResult([], 0, 0.0)
        train = self.config.train
        result = run_inner_steps(
            self.model,
            self.optimizer,
            self.scheduler,
            self.stream.next_batch,
            steps,
            grad_clip=train.grad_clip,
            slowdown=train.slowdown,
            should_stop=should_stop,
        )
        done = len(result.losses)
        if done:
            self.step_time_s = result.seconds / done
        self.inner_steps_total += done
        self.tokens += result.tokens
        return result

    def weights(self) -> torch.Tensor:
        """The model's weights as one flat fp32 vector (a copy)."""
        return flatten_parameters(self.model.parameters())

    def load_all(self, anchor: torch.Tensor) -> None:
        """Load the whole anchor into the model."""
        assign_parameters_(self.model.parameters(), anchor)

    def load(self, anchor: torch.Tensor, fragment: Fragment, mix_alpha: float | None) -> None:
        """Load a fragment of the anchor into the model, mixed as α·local + (1 − α)·anchor when `mix_alpha` is set."""
        if fragment.whole and mix_alpha is None:
            return self.load_all(anchor)
        local = self.weights()
        values = fragment.take(anchor)
        if mix_alpha is not None:
            values = fragment.take(local).mul_(mix_alpha).add_(values, alpha=1.0 - mix_alpha)
        fragment.put(local, values)
        assign_parameters_(self.model.parameters(), local)

    def evaluate(self) -> float:
        """Mean loss on the held-out text, the same windows on every island."""
        config = self.config
        return evaluate(
            self.model, self.shards.eval, config.model.seq_len, config.train.batch_size, config.data.eval_batches
        )

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to resume local training exactly."""
        return {
            "inner_optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "stream": self.stream.state_dict(),
            "inner_steps_total": self.inner_steps_total,
            "tokens": self.tokens,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume local training from `state_dict()`."""
        self.optimizer.load_state_dict(state["inner_optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.stream.load_state_dict(state["stream"])
        self.inner_steps_total = int(state["inner_steps_total"])
        self.tokens = int(state["tokens"])
