"""One configuration tree for a peer: dataclasses with a docstring per field, from TOML and CLI overrides."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2p_diloco.errors import ConfigError
from p2p_diloco.validation import (  # noqa: F401 - the constants are part of the config's public names
    CLIENT_MODES,
    MODEL_KINDS,
    OUTER_DEVICES,
    PRECISIONS,
    RELAY_MODES,
    resolve_paths,
    validate_config,
)

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib


# Every interface, TCP only: p2pd's QUIC lost 28 of 30 state downloads between two hosts (TCP none); opt in: quic-v1.
LISTEN_EVERYWHERE = ("/ip4/0.0.0.0/tcp/0",)


@dataclass
class ModelConfig:
    """The model every island of a run shares: the built-in GPT, a transformers causal LM, or your nn.Module."""

    kind: str = "gpt"
    """'gpt': the built-in byte-level GPT; 'hf': a transformers causal LM from `config`; 'module': `factory`'s."""
    config: str | None = None
    """kind 'hf': a local transformers config.json, or a folder holding one (never downloaded)."""
    init_from: str | None = None
    """kind 'hf': local weights to start from, a .safetensors file or a model folder (never downloaded)."""
    factory: str | None = None
    """kind 'module': 'package.module:function' returning an nn.Module whose forward(input_ids, labels) returns a loss,
    an object with .loss, or (logits, loss); labels[i, t] is the token after input_ids[i, t]."""
    vocab_size: int = 256
    """Byte-level tokens: always 256 unless you bring your own tokenizer."""
    seq_len: int = 64
    """Context length in tokens."""
    d_model: int = 128
    """Width of the residual stream."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention heads per block; must divide d_model."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of d_model."""


@dataclass
class DataConfig:
    """Where text comes from and which shard this island trains on."""

    path: str | None = None
    """A .txt/.md/.jsonl/.json/.parquet file, a folder or a glob of them; None: the built-in corpus."""
    shard_index: int | None = None
    """This island's shard of the training text; None with num_shards > 1 picks one from the peer id."""
    num_shards: int = 1
    """How many equal shards the training text is cut into."""
    eval_fraction: float = 0.05
    """Tail of the corpus held out for eval_loss; the same for every island."""
    eval_batches: int = 4
    """Batches of the held-out text averaged into eval_loss."""
    max_bytes: int = 4_000_000
    """Cap on the corpus size of the built-in byte pipeline (text files with tokenizer 'bytes')."""
    tokenizer: str = "bytes"
    """'bytes' (one token per byte), a tokenizer.json file (the tokenizers library) or a local tokenizer folder."""
    text_field: str = "text"
    """The field that holds the text in .jsonl/.json/.parquet files."""
    streaming: bool = False
    """Read the corpus as a stream instead of preparing it in the Arrow cache first (corpora larger than disk)."""
    cache_dir: str | None = None
    """Where Hugging Face datasets keeps its memory-mapped Arrow cache (default: its own, ~/.cache/huggingface)."""
    eos_token: str | None = None
    """The end-of-text token put between documents (default: the tokenizer's own, e.g. <|endoftext|> or </s>)."""


@dataclass
class TrainConfig:
    """Inner (local AdamW) and outer (Nesterov on pseudo-gradients) optimisation."""

    inner_steps: int = 50
    """H: local AdamW steps between two outer steps."""
    outer_steps: int = 20
    """Stop once the swarm's outer step reaches this many."""
    batch_size: int = 16
    """Sequences per inner step and rank: an island's global batch is batch_size x ranks x grad_accum."""
    lr: float = 3e-3
    """Inner AdamW learning rate."""
    weight_decay: float = 0.1
    """Inner AdamW weight decay."""
    warmup_steps: int = 20
    """Linear warm-up of the inner learning rate, counted in this island's inner steps."""
    grad_clip: float = 1.0
    """Clip the inner gradient norm to this value (0 disables)."""
    outer_lr: float = 0.7
    """Outer Nesterov learning rate."""
    outer_momentum: float = 0.9
    """Outer Nesterov momentum."""
    seed: int = 0
    """Seeds the model initialisation (shared by the run) and this island's batch order."""
    threads: int = 1
    """torch intra-op threads per island; keep small when several islands share a machine."""
    momentum_every: int = 1
    """Delayed Nesterov: update the outer momentum only every N outer steps (1 = plain Nesterov)."""
    slowdown: float = 1.0
    """Make this island this many times slower (for experiments with heterogeneous islands)."""
    dynamic_steps: bool = False
    """Dynamic local updates: a slower island runs proportionally fewer inner steps to arrive with the others."""
    time_budget_s: float = 0.0
    """Stop after this many seconds of training (0: no limit); for fixed wall-clock experiments."""
    fragments: int = 1
    """P (Streaming DiLoCo): outer step s syncs only fragment s mod P, after H/P inner steps (1: whole model)."""
    fragment_layout: str = "strided"
    """'strided' layer groups (block i in fragment i mod P) or 'balanced' (greedy bin-packing: peak within 4/3)."""
    overlap_steps: int = 0
    """τ: inner steps a fragment's exchange runs in the background before its update lands (0: blocking)."""
    mix_alpha: float = 0.5
    """α: with overlap, a landed fragment becomes α·θ_local + (1 − α)·θ_merged."""
    device: str = "auto"
    """Where the model trains: auto (CUDA when present, else CPU), cpu, cuda, cuda:N or mps."""
    precision: str = "auto"
    """fp32, bf16 or fp16 (autocast; fp16 with a gradient scaler); auto is bf16 on GPUs that support it, else fp32."""
    outer_device: str = "cpu"
    """Where the anchor and outer momentum live (fp32): 'cpu' (pinned memory on CUDA) or 'same' as the model."""
    compile: bool = False
    """torch.compile the model."""
    grad_accum: int = 1
    """Micro-batches of batch_size sequences per inner step (gradients accumulated)."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about a third more compute."""
    eval_every: int = 1
    """Evaluate every this many outer steps and at the last (eval_loss is None in the rounds between)."""


@dataclass
class NetworkConfig:
    """How an island finds and talks to the swarm; every timeout is bounded."""

    run_id: str = "p2p-diloco"
    """Islands with the same run id train the same model together."""
    initial_peers: list[str] = field(default_factory=list)
    """Multiaddrs of bootstrap nodes or live peers."""
    host_maddrs: list[str] = field(default_factory=lambda: list(LISTEN_EVERYWHERE))
    """Addresses this island listens on: every interface, TCP, on a port the system picks."""
    announce_maddrs: list[str] = field(default_factory=list)
    """Addresses other peers should dial (behind NAT or a proxy)."""
    identity: str | None = None
    """Key file for a stable peer ID, created if missing."""
    relay: str = "auto"
    """'auto': use a relay when nothing can dial this island, serve as one when reachable; 'off'; 'only' (always)."""
    client_mode: str = "auto"
    """'auto': client mode (outbound only; never lead, reduce, serve state) if unreachable, no relay; 'on'; 'off'."""
    relay_port: int = 0
    """TCP port this island serves relay control on when it is reachable (0: any free port)."""
    direct_lanes: bool = True
    """Send all-reduce parts over TCP straight to islands it can reach (AES-GCM sealed), the rest over libp2p."""
    direct_port: int = 0
    """TCP port of the direct lanes (0: any free port; fix it and open it to be reached directly)."""
    uplink_mbit: float = 0.0
    """This island's upload rate in Mbit/s, if known: its lanes share it evenly, own parts first (0: TCP shares it)."""
    peers_file: str | None = None
    """Keep the multiaddrs of live peers here; a restart joins through them as well as --initial-peers."""
    rebootstrap_s: float = 15.0
    """How often to ping the initial peers again, so that a restarted bootstrap re-learns this island."""
    state_wait_s: float = 30.0
    """How long a newcomer waits for the swarm's state when the run looks alive but no donor answered yet."""
    wait_for_islands: int = 1
    """Before its first round, wait (up to state_wait_s) until this many islands of the run (itself too) announce."""
    swarm_public_key: str | None = None
    """A private swarm's owner public key ('ed25519:...', printed by `p2p-diloco keys new`): only members join."""
    membership: str | None = None
    """This island's membership token file for a private swarm (`p2p-diloco keys invite`; bound to --identity)."""
    revoked: str | None = None
    """An owner-signed revocation list file (`p2p-diloco keys revoke`): those peers are refused."""
    robust_merge: str = "auto"
    """Per-part defence from bad members: 'clip' (CenteredClip), 'trimmed', 'median', 'none'; 'auto': clip if public."""
    ban_rounds: int = 5
    """Rounds a peer that sent NaN/inf or a lying state is excluded for (0: never ban)."""
    target_group_size: int = 8
    """Largest averaging group; a full group starts at once, a smaller one after min_matchmaking_time."""
    expect_rounds: int = 3
    """Start a group once the islands seen in this many last rounds, or announced since, joined (0: wait it out)."""
    quorum: int = 1
    """K: contributions (own included) needed before merging; 1 never waits, the swarm size is synchronous."""
    grace: str = "adaptive"
    """Grace window after the quorum: 'adaptive' (learned from partners' arrival times) or 'fixed' (grace_s)."""
    grace_s: float = 2.0
    """The fixed grace window, or the adaptive window's starting value, in seconds."""
    grace_max_s: float = 10.0
    """Upper bound of the grace window."""
    grace_gamma: float = 0.5
    """Adaptive window: at most this fraction of the island's own compute time per round."""
    merge: str = "tokens"
    """Merge rule: 'tokens' (w = c_tokens * c_tokens / c_steps), 'mean', or 'rda' (radial-directional)."""
    codec: str = "fp32"
    """Codec on the wire, the same on every island: fp32, fp16, bf16, int8, int4 (NF4), int2 or topk (sparse)."""
    error_feedback: bool = False
    """Carry each round's quantization residual into the next round's pseudo-gradient; always on with topk."""
    error_feedback_decay: float = 1.0
    """The share of the carried residual kept each round, in [0, 1] (codec topk: 0.8 unless set)."""
    topk_density: float = 0.02
    """Codec topk: the fraction of each chunk of 4096 pseudo-gradient values that is sent (the largest)."""
    topk_bits: int = 2
    """Codec topk: bits per sent value, 2 or 4 (a sign and a magnitude between the block's smallest and largest)."""
    max_staleness: int = 4
    """A contribution more outer steps behind the swarm than this is rejected (the island resyncs instead)."""
    staleness_discount: float = 0.5
    """A contribution s steps behind the swarm is weighted by discount**s."""
    min_matchmaking_time: float = 1.0
    """Shortest grace window: seconds a group leader waits for more islands before averaging starts."""
    request_timeout: float = 0.8
    """Seconds to wait for a matchmaking reply; must be below min_matchmaking_time."""
    leader_poll_s: float = 0.25
    """Longest gap (s) between look-ups of group leaders while waiting for a group (0: back to back, as hivemind)."""
    averaging_timeout: float = 30.0
    """Bound on waiting for a quorum; past it the island applies its own pseudo-gradient."""
    allreduce_timeout: float = 60.0
    """Seconds an all-reduce may take once a group is formed."""
    next_chunk_timeout: float = 5.0
    """A partner silent for this long is dropped and the round discarded."""
    join_timeout: float = 30.0
    """Seconds to reach the initial peers before giving up with an error."""
    state_timeout: float = 60.0
    """Seconds to download the swarm's state when joining late."""
    dht_timeout: float = 10.0
    """Bound on one DHT read or write of the run's records; past it the island goes on with its last view."""
    dht_rpc_timeout: float = 1.0
    """Seconds a DHT request waits for a reply: a frozen peer stalls every look-up this long (hivemind: 3 s)."""
    announce_ttl: float = 60.0
    """Seconds an island's record lives in the DHT unless renewed: a dead island stops counting after this."""
    announce_every: int = 4
    """Rounds between announces of this island (each reads the others' records); at least one per announce_ttl / 3."""
    dht_walk_every: int = 4
    """Every this many reads or writes of a DHT key walk as hivemind does; a replica serves the others (1: all walk)."""
    declare_state_period: float = 10.0
    """How often an island re-announces itself as a state donor for late joiners."""
    shutdown_timeout: float = 3.0
    """Seconds the averager process gets to stop cleanly before it is killed."""
    solo: bool = False
    """Train alone without any network (a baseline to compare the swarm against)."""


@dataclass
class IslandConfig:
    """How many processes one island is: ranks on torch.distributed inside it, one member of the swarm outside."""

    nproc_per_node: int = 1
    """Ranks to start on this machine, through torch's elastic launcher as torchrun does (1: a single process)."""
    nnodes: str = "1"
    """Machines of this island, or MIN:MAX, as torchrun's --nnodes; more than one needs rdzv_endpoint."""
    rdzv_endpoint: str = ""
    """HOST:PORT of the island's c10d rendezvous, the same on every node of a multi-node island."""
    rdzv_id: str = ""
    """Rendezvous id that the island's nodes share (default: the run id)."""
    max_restarts: int = 0
    """Restart a failed island in place this many times (every rank; it resumes from its checkpoint)."""
    parallel: str = "ddp"
    """How ranks share the work: 'ddp' (each holds the model) or 'fsdp' (FSDP2: parameters, grads, state sharded)."""
    rank_timeout_s: float = 3600.0
    """How long a rank waits in one collective for the others (rank 0 may talk to the swarm meanwhile)."""


@dataclass
class PeerConfig:
    """Everything one island needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    island: IslandConfig = field(default_factory=IslandConfig)
    metrics: str | None = None
    """JSON-lines file that gets one record per outer step."""
    checkpoint_dir: str | None = None
    """Folder for atomic checkpoints of the island's outer state; resumed from on restart."""
    checkpoint_every: int = 1
    """Write a checkpoint every this many outer steps."""
    log_level: str = "INFO"
    """Logging level of p2p-diloco's own messages."""
    fresh: bool = False
    """Start over: ignore the checkpoints in --checkpoint-dir (needed when every one of them is corrupt)."""
    standby: bool = False
    """Wait, started and loaded, for the island using --checkpoint-dir to stop or die, then take over at once."""
    tensorboard: str | None = None
    """Also write every numeric metric as a TensorBoard scalar under this folder."""
    wandb: str | None = None
    """Also log every numeric metric to this Weights & Biases project (needs p2p-diloco[wandb]; offline works)."""


SECTIONS = ("model", "data", "train", "network", "island")
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _coerce(value: Any, target_type: Any, name: str) -> Any:
    """Convert a TOML/CLI value to the declared field type, or raise ConfigError."""
    type_text = str(target_type)
    try:
        if type_text.startswith("list"):
            if isinstance(value, str):
                return [item for item in value.split(",") if item]
            return list(value)
        if value is None:
            return None
        if "int" in type_text and "float" not in type_text:
            number = float(value) if isinstance(value, str) else value
            if isinstance(number, bool) or not isinstance(number, (int, float)) or not float(number).is_integer():
                raise ValueError("it must be a whole number")
            return int(number)
        if "float" in type_text:
            number = float(value)
            if not math.isfinite(number):
                raise ValueError("it must be a finite number")
            return number
        if "bool" in type_text:
            if isinstance(value, bool):
                return value
            if str(value).lower() not in TRUE + FALSE:
                raise ValueError("it must be true or false")
            return str(value).lower() in TRUE
        return str(value)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"config field {name!r}: cannot use {value!r} ({error})") from None


def _apply(section_obj: Any, values: dict[str, Any], section_name: str) -> None:
    known = {f.name: f for f in dataclasses.fields(section_obj)}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(
                f"unknown config field {section_name + '.' if section_name else ''}{key}; "
                f"known: {', '.join(sorted(known))}"
            )
        if dataclasses.is_dataclass(getattr(section_obj, key)):
            if not isinstance(value, dict):
                raise ConfigError(f"config section [{key}] must be a table")
            _apply(getattr(section_obj, key), value, key)
        else:
            setattr(section_obj, key, _coerce(value, known[key].type, key))


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> PeerConfig:
    """Build a PeerConfig from defaults, an optional TOML file, then dotted overrides like {'train.lr': 1e-3}."""
    config = PeerConfig()
    given: set[str] = set()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            values = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"config file {path} is not valid TOML: {error}") from None
        _apply(config, values, "")
        resolve_paths(config, values, path.parent)
        given |= set(_dotted_keys(values))
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        given.add(dotted)
        *parents, leaf = dotted.split(".")
        target = config
        for parent in parents:
            target = getattr(target, parent, None)
            if not dataclasses.is_dataclass(target):
                raise ConfigError(f"unknown config section in {dotted!r}")
        _apply(target, {leaf: value}, ".".join(parents))
    apply_codec_defaults(config, given)
    validate_config(config)
    return config


def _dotted_keys(values: dict[str, Any], prefix: str = "") -> list[str]:
    """'section.key' for every leaf of a parsed TOML table."""
    nested = (_dotted_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [prefix + k] for k, v in values.items())
    return [key for keys in nested for key in keys]


SPARSE_DEFAULTS = {"train.outer_lr": 1.2, "train.outer_momentum": 0.0, "network.error_feedback_decay": 0.7}
"""Codec topk's defaults unless set: outer SGD (its residual carries past rounds), swept by sparse_horizon.py."""


def apply_codec_defaults(config: PeerConfig, given: set[str]) -> None:
    """Give codec topk its own outer optimizer and error feedback defaults where the file and flags left them unset."""
    for dotted, value in SPARSE_DEFAULTS.items() if config.network.codec == "topk" else ():
        if dotted not in given:
            section, key = dotted.split(".")
            setattr(getattr(config, section), key, value)
