"""An island's model: the built-in byte-level GPT (pre-LayerNorm), or a transformers or user model by kind.

Every island model has forward(input_ids, targets) -> (logits, mean cross-entropy), so training, evaluation and
the outer loop do not care which kind it is.
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.nn.functional as F
from torch import nn

from p2p_diloco.config import ModelConfig


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused QKV projection."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.d_model % config.n_heads:
            raise ValueError(f"d_model={config.d_model} must be divisible by n_heads={config.n_heads}")
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over earlier positions only; [B, T, C] -> [B, T, C]."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # [B, T, C] -> [B, heads, T, head_dim], the layout scaled_dot_product_attention expects
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    """Position-wise feed-forward network with a GELU."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.mlp_ratio * config.d_model)
        self.proj = nn.Linear(config.mlp_ratio * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, C] -> [B, T, C]."""
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, C] -> [B, T, C]."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """Token + learned position embeddings, n_layers blocks, final LayerNorm and a tied LM head."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # Weight tying: one matrix embeds bytes and scores them, fewer parameters to average across islands
        self.lm_head.weight = self.tok_emb.weight
        self.checkpointing = False

    @property
    def vocab_size(self) -> int:
        """Rows of the token embedding."""
        return self.config.vocab_size

    def enable_checkpointing(self) -> None:
        """Recompute each block's activations in the backward pass."""
        self.checkpointing = True

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B, T, V] for token ids [B, T]; loss = mean cross-entropy when targets are given."""
        T = idx.shape[1]
        if T > self.config.seq_len:
            raise ValueError(f"sequence of length {T} is longer than model.seq_len={self.config.seq_len}")
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            if self.checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def _init_weights(module: nn.Module) -> None:
    """GPT-2 style init: normal(0, 0.02) weights and zero biases; LayerNorms keep their ones/zeros."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


GPT_FIELDS = ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio")


def build_model(config: ModelConfig, seed: int) -> nn.Module:
    """The model of `config.kind`, with weights that depend only on (config, seed); the global RNG is untouched."""
    if config.kind == "hf":
        from p2p_diloco.train.hf_model import build_hf_model

        return build_hf_model(config, seed)
    if config.kind == "module":
        from p2p_diloco.train.module_model import build_module_model

        return build_module_model(config.factory, seed)
    return build_gpt(config, seed)


def model_identity(config: ModelConfig) -> str:
    """What islands of one run must agree on about the model besides its parameter shapes (a canonical string)."""
    if config.kind == "hf":
        from p2p_diloco.train.hf_model import config_identity, load_hf_config

        return "hf:" + config_identity(load_hf_config(config.config))
    if config.kind == "module":
        return f"module:{config.factory}"
    return json.dumps({name: getattr(config, name) for name in GPT_FIELDS}, sort_keys=True)


def model_vocab_size(model: nn.Module) -> int | None:
    """The model's vocabulary (rows of its input embedding), or None when it does not say."""
    if isinstance(getattr(model, "vocab_size", None), int):
        return model.vocab_size
    inner = getattr(model, "module", None)
    embeddings = getattr(inner, "get_input_embeddings", None)
    return embeddings().num_embeddings if callable(embeddings) else None


def build_gpt(config: ModelConfig, seed: int) -> TinyGPT:
    """Build a TinyGPT whose weights depend only on (config, seed), leaving the global RNG untouched."""
    # Every island must start from bit-identical weights; forking keeps the caller's RNG stream unchanged
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyGPT(config)
        model.apply(_init_weights)
    return model


def count_parameters(model: nn.Module) -> int:
    """Number of trainable scalars (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def model_fingerprint(model: nn.Module) -> str:
    """16-hex-char hash of the ordered (name, shape, dtype) of every parameter: architecture, not values."""
    digest = hashlib.blake2b(digest_size=8)
    for name, param in model.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
    return digest.hexdigest()
