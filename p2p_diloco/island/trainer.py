"""An island's local training: the model on its device, its inner AdamW and schedule, its batches, the eval.

The outer loop sees the model only as one flat fp32 vector. On CUDA (with --outer-device cpu, the default) that
vector lives in pinned host memory and every copy runs per parameter, asynchronously, so no second full copy of
the model is ever made on the GPU.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from p2p_diloco.config import PeerConfig
from p2p_diloco.diloco.fragments import Fragment
from p2p_diloco.diloco.inner import InnerResult, dynamic_inner_steps, make_inner_optimizer, run_inner_steps
from p2p_diloco.errors import ConfigError
from p2p_diloco.island.ranks import RankGroup
from p2p_diloco.train.checkpoint import CheckpointError
from p2p_diloco.train.data import evaluate_batches
from p2p_diloco.train.devices import Precision, host_buffer, memory_gb, resolve_device, resolve_precision
from p2p_diloco.train.model import build_model, model_fingerprint, model_identity, model_vocab_size
from p2p_diloco.train.parallel import load_sharded, load_whole, whole_parameters, wrap_model
from p2p_diloco.train.sources import Stream, TrainingData, prepare_data
from p2p_diloco.train.tokenizer import Tokenizer


def run_fingerprint(model: torch.nn.Module, config: PeerConfig, tokenizer: Tokenizer | None = None) -> str:
    """Identifies what islands must share: parameter names and shapes, the model config, the tokenizer, the schema."""
    schema = "rda" if config.network.merge == "rda" else "flat"
    if config.train.fragment_layout != "strided":  # islands must cut the same fragments (strided: as before)
        schema += f"|fragments:{config.train.fragment_layout}"
    text = model_fingerprint(model) + model_identity(config.model) + schema
    if tokenizer is not None and tokenizer.fingerprint != "bytes":
        text += f"|tokenizer:{tokenizer.fingerprint}"
    return f"{zlib.crc32(text.encode()):08x}{model_fingerprint(model)[:8]}"


def check_vocabulary(model: torch.nn.Module, tokenizer: Tokenizer, config: PeerConfig) -> None:
    """A tokenizer whose ids the model cannot embed is a one-line error naming both sizes."""
    size = model_vocab_size(model)
    if size is not None and tokenizer.vocab_size > size:
        where = "vocab_size in --model-config" if config.model.kind == "hf" else "[model] vocab_size"
        raise ConfigError(
            f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} tokens but the model embeds only {size}; "
            f"set {where} to at least {tokenizer.vocab_size} or use the model's own tokenizer"
        )


class LocalTrainer:
    """Runs inner steps on this island's shard and moves weights in and out of the model as flat vectors.

    With `ranks` it is one rank of a multi-process island: the model is wrapped in DDP or sharded with FSDP2, and
    every rank reads the island's stream of global batches (batch_size x ranks rows) and trains on its own slice,
    so the ranks stay in step and a checkpoint needs one stream position.
    """

    def __init__(self, config: PeerConfig, data: TrainingData | None = None, ranks: RankGroup | None = None):
        self.config = config
        self.ranks = ranks
        train = config.train
        self.device = ranks.device if ranks is not None else resolve_device(train.device)
        self.precision = Precision(resolve_precision(train.precision, self.device), self.device)
        self.model = build_model(config.model, seed=train.seed)
        self.data = data or self._prepare_data()
        check_vocabulary(self.model, self.data.tokenizer, config)
        if train.activation_checkpointing:
            self.model.enable_checkpointing()
        self.model.to(self.device)
        self.sync_context = None
        wrapped = self.model
        if ranks is not None:
            wrapped, self.sync_context = wrap_model(self.model, ranks.parallel, self.device)
        self.forward_model = torch.compile(wrapped) if train.compile else wrapped
        # DDP's forward is for training; evaluation runs the bare model (FSDP's forward gathers the shards).
        self.eval_model = self.forward_model if ranks is None or ranks.parallel == "fsdp" else self.model
        self.optimizer, self.scheduler = make_inner_optimizer(
            self.model, train.lr, train.weight_decay, train.warmup_steps, fused=self.device.type == "cuda"
        )
        self.numel = sum(parameter.numel() for parameter in self.model.parameters())
        self.stream: Stream | None = None
        self.shard = ""
        self.inner_steps_total = 0
        self.tokens = 0
        self.step_time_s: float | None = None
        """Seconds per inner step in the last round (announced for dynamic local updates)."""

    @property
    def world(self) -> int:
        """The island's number of ranks (1 for a single process)."""
        return 1 if self.ranks is None else self.ranks.world

    def _prepare_data(self) -> TrainingData:
        """The run's data; with ranks, rank 0 prepares (and caches) it before the others read the cache."""
        if self.ranks is None:
            return prepare_data(self.config)
        if not self.ranks.leader:
            self.ranks.barrier()
        data = prepare_data(self.config)
        if self.ranks.leader:
            self.ranks.barrier()
        return data

    def open_stream(self, peer_id: str) -> None:
        """Start this island's batch stream: its shard, in an order seeded by the shard (or the peer id)."""
        self.stream, self.shard = self.data.stream(self.config, peer_id, rows=self.config.train.batch_size * self.world)

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch of this rank: its slice of the island's global batch."""
        inputs, targets = self.stream.next_batch()
        if self.ranks is None:
            return inputs, targets
        rows = self.config.train.batch_size
        start = self.ranks.rank * rows
        return inputs[start : start + rows], targets[start : start + rows]

    @property
    def tensor_sizes(self) -> list[int]:
        """Element counts of the parameters, in module order."""
        return [parameter.numel() for parameter in self.model.parameters()]

    def planned_steps(self, others_step_time_s: list[float | None]) -> int:
        """H, or with dynamic local updates fewer for an island slower than the others (`dynamic_inner_steps`)."""
        train = self.config.train
        return dynamic_inner_steps(train.inner_steps, self.step_time_s, others_step_time_s, enabled=train.dynamic_steps)

    def train(self, steps: int, should_stop: Callable[[], bool] | None = None) -> InnerResult:
        """Run `steps` inner steps (none for 0; fewer when `should_stop()` says so) and count them."""
        if steps <= 0:
            return InnerResult([], 0, 0.0)
        train = self.config.train
        result = run_inner_steps(
            self.forward_model,
            self.optimizer,
            self.scheduler,
            self._next_batch,
            steps,
            grad_clip=train.grad_clip,
            # Only rank 0 stretches its steps: the others wait for it in the all-reduce anyway, and ranks that each
            # stretched a step timed with the others' waits would slow each other down without bound.
            slowdown=train.slowdown if self.ranks is None or self.ranks.leader else 1.0,
            should_stop=should_stop,
            accumulate=train.grad_accum,
            autocast=self.precision.autocast,
            scaler=self.precision.scaler,
            device=self.device,
            sync_context=self.sync_context,
        )
        # Every rank trained on an equal slice: the island's tokens are the world's.
        result = InnerResult(result.losses, result.tokens * self.world, result.seconds)
        done = len(result.losses)
        if done:
            self.step_time_s = result.seconds / done
        self.inner_steps_total += done
        self.tokens += result.tokens
        return result

    @torch.no_grad()
    def weights(self) -> torch.Tensor:
        """The model's weights as one flat fp32 CPU vector (a copy; per parameter, so never a second GPU copy)."""
        if self.config.train.outer_device == "same" and self.device.type != "cpu":
            return torch.cat([p.reshape(-1).float() for p in whole_parameters(self.model)])
        flat = host_buffer(self.numel, self.device)
        offset = 0
        for parameter in whole_parameters(self.model):
            count = parameter.numel()
            flat[offset : offset + count].copy_(parameter.reshape(-1), non_blocking=True)
            offset += count
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return flat

    @torch.no_grad()
    def load_all(self, anchor: torch.Tensor) -> None:
        """Load the whole anchor into the model."""
        if anchor.numel() != self.numel:
            raise ValueError(f"flat vector has {anchor.numel()} values, the parameters {self.numel}")
        offset = 0
        for parameter in self.model.parameters():
            count = parameter.numel()
            load_whole(parameter, anchor[offset : offset + count])
            offset += count
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the anchor may change once this returns

    def load(self, anchor: torch.Tensor, fragment: Fragment, mix_alpha: float | None) -> None:
        """Load a fragment of the anchor into the model, mixed as α·local + (1 − α)·anchor when `mix_alpha` is set."""
        if fragment.whole and mix_alpha is None:
            return self.load_all(anchor)
        local = self.weights()
        values = fragment.take(anchor)
        if mix_alpha is not None:
            values = fragment.take(local).mul_(mix_alpha).add_(values, alpha=1.0 - mix_alpha)
        fragment.put(local, values)
        self.load_all(local)

    def evaluate(self) -> float:
        """Mean loss on the held-out batches, the same on every island."""
        return evaluate_batches(self.eval_model, self.data.eval_batches, self.precision.autocast)

    def memory_gb(self) -> float | None:
        """Peak GPU memory of this island so far (None off CUDA)."""
        return memory_gb(self.device)

    def resources(self) -> dict[str, Any]:
        """What a round's record says about the island's hardware: GPU memory, ranks and how they share the model."""
        parallel = None if self.ranks is None else self.ranks.parallel
        return {"gpu_mem_gb": self.memory_gb(), "ranks": self.world, "island_parallel": parallel}

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """What a checkpoint of outer step `step` needs to resume local training exactly."""
        state = {
            "inner_optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "stream": self.stream.state_dict(),
            "inner_steps_total": self.inner_steps_total,
            "tokens": self.tokens,
        }
        if self.precision.scaler is not None:
            state["grad_scaler"] = self.precision.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume local training from `state_dict()`."""
        sharded = self.ranks is not None and self.ranks.parallel == "fsdp"
        if ("inner_shards" in state) != sharded:
            written = "an FSDP island" if "inner_shards" in state else "a DDP or one-process island"
            raise CheckpointError(
                f"the checkpoint in {self.config.checkpoint_dir} was written by {written}; resume it with the same "
                "--island-parallel, or pass --fresh (the island then takes the swarm's state)"
            )
        if sharded:  # every rank reads its shards, resharded by DCP when the rank count changed
            load_sharded(self.model, self.optimizer, Path(self.config.checkpoint_dir) / state["inner_shards"])
        else:
            self.optimizer.load_state_dict(state["inner_optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.stream.load_state_dict(state["stream"])
        self.inner_steps_total = int(state["inner_steps_total"])
        self.tokens = int(state["tokens"])
        if self.precision.scaler is not None and "grad_scaler" in state:
            self.precision.scaler.load_state_dict(state["grad_scaler"])
