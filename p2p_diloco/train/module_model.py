"""Your own nn.Module as an island's model: `factory = "package.module:function"` returns it.

Its forward(input_ids, labels) returns a loss, an object with `.loss` (a transformers output), or (logits, loss);
labels[i, t] is the token that follows input_ids[i, t]. The factory runs under a fixed seed, so every island
starts from the same weights as long as the factory draws them from torch's generator.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from p2p_diloco.train.hf_model import ModelError


class ModuleLM(nn.Module):
    """A user module behind forward(input_ids, targets) -> (logits or None, loss)."""

    def __init__(self, module: nn.Module, factory: str):
        super().__init__()
        self.module, self.factory = module, factory

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[Any, Any]:
        """Whatever the module returns, as (logits, loss)."""
        output = self.module(idx, targets)
        if isinstance(output, torch.Tensor) and output.ndim == 0:
            return None, output
        if isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], torch.Tensor):
            return output
        loss = getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor):
            return getattr(output, "logits", None), loss
        raise ModelError(
            f"the model of --model-factory {self.factory} returned {type(output).__name__}; its forward(input_ids, "
            "labels) must return a loss, an object with .loss, or (logits, loss)"
        )

    def enable_checkpointing(self) -> None:
        """The module's own gradient checkpointing, when it has one (as transformers models do)."""
        if not hasattr(self.module, "gradient_checkpointing_enable"):
            raise ModelError(
                f"--activation-checkpointing: the model of {self.factory} has no gradient_checkpointing_enable(); "
                "checkpoint inside your module instead"
            )
        self.module.gradient_checkpointing_enable()


def build_module_model(factory: str, seed: int) -> ModuleLM:
    """Import `package.module:function`, call it under `seed`, and check it returned an nn.Module."""
    module_name, _, function_name = factory.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise ModelError(f"--model-factory {factory} cannot be imported ({error}); is it on PYTHONPATH?") from None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = function()
    if not isinstance(module, nn.Module):
        raise ModelError(f"--model-factory {factory} returned {type(module).__name__}, not a torch nn.Module")
    return ModuleLM(module.float(), factory)
