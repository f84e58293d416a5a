"""A transformers causal LM (Llama, Qwen, GPT-2, ...) built from a local config.json, optionally from local weights.

Nothing is downloaded: `from_config` builds the architecture with seeded initial weights (the same on every
island), and `init_from` loads a .safetensors file or a saved model folder. The wrapper gives it the interface
every island model has: forward(input_ids, targets) -> (logits, mean cross-entropy).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from p2p_diloco.config import ModelConfig
from p2p_diloco.errors import UserError

VOLATILE_KEYS = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures", "use_cache")
"""Config keys that do not change the model: left out of the run's fingerprint."""


class ModelError(UserError, ValueError):
    """A model configuration or weights file the user must fix; the message says what."""


class HFCausalLM(nn.Module):
    """A transformers causal LM behind forward(input_ids, targets) -> (logits, loss)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        """Logits [B, T, V]; loss = mean cross-entropy against targets (already shifted by one)."""
        logits = self.model(input_ids=idx, use_cache=False).logits
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding."""
        return self.model.get_input_embeddings().num_embeddings

    def enable_checkpointing(self) -> None:
        """Recompute activations in backward (transformers' gradient checkpointing)."""
        if hasattr(self.model, "activation_checkpointing_enable"):  # its name from transformers 5.x on
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def load_hf_config(path: str) -> Any:
    """The transformers config of a config.json or a model folder (local files only)."""
    from transformers import AutoConfig

    source = Path(path).expanduser()
    if not source.exists():
        raise ModelError(f"--model-config {path} does not exist; give a local config.json or a model folder")
    try:
        return AutoConfig.from_pretrained(str(source), local_files_only=True)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelError(f"--model-config {path} is not a transformers model config ({first})") from None


def config_identity(hf_config: Any) -> str:
    """The config as canonical JSON without the keys that do not change the model."""
    values = {key: value for key, value in hf_config.to_dict().items() if key not in VOLATILE_KEYS}
    return json.dumps(values, sort_keys=True, default=str)


def build_hf_model(config: ModelConfig, seed: int) -> HFCausalLM:
    """The causal LM of `config.config`, seeded (or loaded from `config.init_from`), in fp32."""
    from transformers import AutoModelForCausalLM

    hf_config = load_hf_config(config.config)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(hf_config)
    except (ValueError, KeyError) as error:
        raise ModelError(f"--model-config {config.config}: not a causal LM transformers can build ({error})") from None
    model = model.float()
    if config.init_from:
        _load_weights(model, config.init_from)
    return HFCausalLM(model)


def _load_weights(model: nn.Module, path: str) -> None:
    """Load a .safetensors file, or a folder's model.safetensors (or shards), into `model`, checking every name."""
    from safetensors.torch import load_file

    source = Path(path).expanduser()
    files = [source] if source.is_file() else sorted(source.glob("*.safetensors")) if source.is_dir() else []
    if not files:
        raise ModelError(f"--init-from {path}: no .safetensors weights there; give a file or a saved model folder")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(str(file)))
        except Exception as error:  # safetensors raises its own SafetensorError for a damaged file
            raise ModelError(f"--init-from {file} cannot be read ({error})") from None
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as error:
        first = str(error).strip().splitlines()[1 if "\n" in str(error) else 0].strip()
        raise ModelError(f"--init-from {path} does not fit --model-config ({first})") from None
    tying = bool(getattr(model.config, "tie_word_embeddings", False))
    tied = {name for name in missing if name.endswith("lm_head.weight") and tying}
    if set(missing) - tied or unexpected:
        names = sorted(set(missing) - tied)[:3] + sorted(unexpected)[:3]
        raise ModelError(f"--init-from {path} does not fit --model-config (e.g. {', '.join(names)})")
    if tied:
        model.tie_weights()
