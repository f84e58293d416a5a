"""Checks of a peer's configuration: each bad value is a one-line ConfigError that says what to change."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2p_diloco.diloco.fragments import LAYOUTS
from p2p_diloco.diloco.grace import GRACE_MODES
from p2p_diloco.diloco.merge import MERGE_RULES
from p2p_diloco.diloco.quantize import CODEC_NAMES
from p2p_diloco.diloco.robust import ROBUST_MERGES
from p2p_diloco.errors import ConfigError

if TYPE_CHECKING:
    from p2p_diloco.config import NetworkConfig, PeerConfig

RELAY_MODES = ("auto", "off", "only")
CLIENT_MODES = ("auto", "on", "off")
MODEL_KINDS = ("gpt", "hf", "module")
DEVICES_HELP = "auto, cpu, cuda, cuda:N or mps"
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
OUTER_DEVICES = ("cpu", "same")
ISLAND_PARALLEL = ("ddp", "fsdp")

PATHS_IN_FILES = ("model.config", "model.init_from", "data.tokenizer", "data.path")
"""Config fields that name files: written in a TOML file, they are relative to that file's folder."""


def resolve_paths(config: PeerConfig, values: dict[str, Any], folder: Path) -> None:
    """Make the path fields a TOML file set relative to the file's folder (flags stay relative to the cwd)."""
    for dotted in PATHS_IN_FILES:
        section, leaf = dotted.split(".")
        value = values.get(section, {}).get(leaf) if isinstance(values.get(section), dict) else None
        if not isinstance(value, str) or (dotted == "data.tokenizer" and value == "bytes"):
            continue
        expanded = Path(value).expanduser()
        if not expanded.is_absolute() and not any(char in value for char in "*?["):
            expanded = folder / expanded
        elif not expanded.is_absolute():  # a glob: keep it a pattern, anchored at the file's folder
            expanded = Path(folder, value)
        setattr(getattr(config, section), leaf, str(expanded))


def _validate_workload(config: PeerConfig) -> None:
    """The model kind, device, precision and data options."""
    model, train, data = config.model, config.train, config.data
    if model.kind not in MODEL_KINDS:
        raise ConfigError(f"model.kind must be one of {', '.join(MODEL_KINDS)}; got {model.kind!r}")
    if model.kind == "hf" and not model.config:
        raise ConfigError("model.kind = 'hf' needs --model-config: a local config.json or a model folder")
    if model.kind == "module" and not (model.factory and ":" in model.factory):
        raise ConfigError("model.kind = 'module' needs --model-factory 'package.module:function'")
    if model.init_from and model.kind != "hf":
        raise ConfigError("model.init_from is for model.kind = 'hf' (a module factory loads its own weights)")
    device = train.device
    if device not in ("auto", "cpu", "cuda", "mps") and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise ConfigError(f"train.device must be {DEVICES_HELP}; got {device!r}")
    for name, value, choices in (
        ("train.precision", train.precision, PRECISIONS),
        ("train.outer_device", train.outer_device, OUTER_DEVICES),
        ("train.fragment_layout", train.fragment_layout, LAYOUTS),
    ):
        if value not in choices:
            raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    if train.grad_accum < 1:
        raise ConfigError(f"train.grad_accum={train.grad_accum} must be >= 1")
    if train.eval_every < 1:
        raise ConfigError(f"train.eval_every={train.eval_every} must be >= 1 (1: evaluate every outer step)")
    if not data.text_field:
        raise ConfigError("data.text_field must name the field that holds the text")
    _validate_island(config)
    _validate_codec(config)


def _validate_codec(config: PeerConfig) -> None:
    """Error feedback and the sparse codec's options."""
    network = config.network
    if (network.error_feedback or network.codec == "topk") and network.merge == "rda":
        raise ConfigError("network.error_feedback (and codec topk, which needs it) does not combine with merge 'rda'")
    if not 0 < network.topk_density <= 1:
        raise ConfigError(
            f"network.topk_density={network.topk_density} must be in (0, 1]: the share of values codec topk sends "
            "(e.g. 0.02)"
        )
    if network.topk_bits not in (2, 4):
        raise ConfigError(f"network.topk_bits={network.topk_bits} must be 2 or 4")
    if network.codec == "topk" and network.robust_merge in ("median", "trimmed"):
        raise ConfigError(
            f"network.robust_merge '{network.robust_merge}' treats the values few islands chose as outliers and drops "
            "most of a topk merge: use 'clip' (or 'auto') or 'none' with codec topk"
        )
    if not 0 <= network.error_feedback_decay <= 1:
        raise ConfigError(f"network.error_feedback_decay={network.error_feedback_decay} must be in [0, 1]")


def _validate_island(config: PeerConfig) -> None:
    """The ranks of one island: how many, on how many nodes, and how they share the model."""
    island = config.island
    if island.nproc_per_node < 1 or island.max_restarts < 0 or not island.rank_timeout_s > 0:
        raise ConfigError("island.nproc_per_node must be >= 1, max_restarts >= 0 and rank_timeout_s > 0")
    if island.parallel not in ISLAND_PARALLEL:
        raise ConfigError(f"--island-parallel must be one of {', '.join(ISLAND_PARALLEL)}; got {island.parallel!r}")
    bounds = island.nnodes.split(":")
    if len(bounds) > 2 or not all(b.isdigit() and int(b) >= 1 for b in bounds) or int(bounds[0]) > int(bounds[-1]):
        raise ConfigError(f"--nnodes must be a count like 2 or a range like 1:4; got {island.nnodes!r}")
    if int(bounds[-1]) > 1 and not island.rdzv_endpoint:
        raise ConfigError("an island on several nodes needs --rdzv-endpoint HOST:PORT, the same on every node")


def validate_config(config: PeerConfig) -> None:
    """Reject values that cannot work, with a message that says what to change."""
    model, train, network = config.model, config.train, config.network
    if model.d_model % model.n_heads:
        raise ConfigError(f"model.d_model={model.d_model} must be divisible by model.n_heads={model.n_heads}")
    for name, value in (("train.lr", train.lr), ("train.outer_lr", train.outer_lr)):
        if not value > 0:
            raise ConfigError(f"{name}={value} must be a positive learning rate")
    if train.weight_decay < 0 or train.grad_clip < 0:
        raise ConfigError("train.weight_decay and train.grad_clip must be >= 0")
    if not 0 < network.staleness_discount <= 1 or network.max_staleness < 0 or network.ban_rounds < 0:
        raise ConfigError("network.staleness_discount must be in (0, 1], max_staleness and ban_rounds >= 0")
    names = [f.name for f in dataclasses.fields(network)]
    bounds = [n for n in names if n.endswith(("_timeout", "_time", "_ttl"))]
    if bad := [n for n in bounds if not getattr(network, n) > 0] + [
        n for n in names if n.endswith("_s") and not getattr(network, n) >= 0
    ]:
        raise ConfigError(f"network.{bad[0]}={getattr(network, bad[0])} must be a positive number of seconds")
    _check_paths(config)
    _validate_workload(config)
    if train.inner_steps < 1 or train.outer_steps < 1 or train.batch_size < 1:
        raise ConfigError("train.inner_steps, train.outer_steps and train.batch_size must be >= 1")
    if not 0 <= train.outer_momentum < 1:
        raise ConfigError(f"train.outer_momentum={train.outer_momentum} must be in [0, 1)")
    _validate_network(network)
    if train.slowdown < 1 or train.momentum_every < 1:
        raise ConfigError("train.slowdown and train.momentum_every must be >= 1")
    if train.fragments < 1 or train.fragments > train.inner_steps:
        raise ConfigError(f"train.fragments={train.fragments} must be in [1, train.inner_steps={train.inner_steps}]")
    if not 0 <= train.overlap_steps <= train.inner_steps // train.fragments:
        raise ConfigError(
            f"train.overlap_steps={train.overlap_steps} must be in [0, inner_steps / fragments = "
            f"{train.inner_steps // train.fragments}]: an exchange must land before the next one starts"
        )
    if not 0 <= train.mix_alpha <= 1:
        raise ConfigError(f"train.mix_alpha={train.mix_alpha} must be in [0, 1]")
    if train.fragments > 1 and train.momentum_every > 1:
        raise ConfigError("Delayed Nesterov (train.momentum_every > 1) does not combine with train.fragments > 1")
    if "." in network.run_id or not network.run_id:
        raise ConfigError(f"run id {network.run_id!r} must be non-empty and contain no '.'")
    if config.data.num_shards < 1:
        raise ConfigError("data.num_shards must be >= 1")
    if config.data.shard_index is not None and not 0 <= config.data.shard_index < config.data.num_shards:
        raise ConfigError(f"data.shard_index must be in [0, {config.data.num_shards})")


def _validate_network(network: NetworkConfig) -> None:
    """Reject matchmaking, announce and port settings that cannot work."""
    for name in ("request_timeout", "leader_poll_s"):
        if getattr(network, name) >= network.min_matchmaking_time:
            raise ConfigError(f"network.{name} must be smaller than network.min_matchmaking_time")
    if min(network.announce_every, network.dht_walk_every) < 1 or not 0 <= network.direct_port < 65536:
        raise ConfigError("network.announce_every and dht_walk_every must be >= 1, direct_port in 0..65535 (0: any)")
    if not 0 <= network.relay_port < 65536:
        raise ConfigError(f"network.relay_port={network.relay_port} must be in 0..65535 (0: any)")
    if not 0 <= network.uplink_mbit < math.inf:
        raise ConfigError(f"network.uplink_mbit={network.uplink_mbit} must be a rate in Mbit/s, or 0 (unpaced)")
    if network.quorum < 1 or network.target_group_size < network.quorum or network.wait_for_islands < 1:
        raise ConfigError("network.target_group_size must be >= network.quorum >= 1, network.wait_for_islands >= 1")
    if network.expect_rounds < 0:
        raise ConfigError(f"network.expect_rounds={network.expect_rounds} must be >= 0 (0: always wait the window out)")
    for name, value, choices in (
        ("network.relay", network.relay, RELAY_MODES),
        ("network.client_mode", network.client_mode, CLIENT_MODES),
        ("network.grace", network.grace, GRACE_MODES),
        ("network.merge", network.merge, MERGE_RULES),
        ("network.codec", network.codec, CODEC_NAMES),
        ("network.robust_merge", network.robust_merge, ("auto", *ROBUST_MERGES)),
    ):
        if value not in choices:
            raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_paths(config: PeerConfig) -> None:
    """Output paths that point at the wrong kind of thing."""
    if config.metrics and Path(config.metrics).is_dir():
        raise ConfigError(f"--metrics {config.metrics} is a folder; give a file path such as runs/island.jsonl")
    if config.checkpoint_dir and Path(config.checkpoint_dir).exists() and not Path(config.checkpoint_dir).is_dir():
        raise ConfigError(f"--checkpoint-dir {config.checkpoint_dir} is a file; give a folder for the checkpoints")
    for name in ("membership", "revoked"):
        path = getattr(config.network, name)
        if path and not Path(path).is_file():
            raise ConfigError(f"--{name} {path} does not exist")
    if config.network.membership and not config.network.swarm_public_key:
        raise ConfigError("--membership needs --swarm-public-key (the owner public key of the private swarm)")
