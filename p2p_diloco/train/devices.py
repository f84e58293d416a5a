"""Where an island trains and in which precision: device choice, autocast, the fp16 gradient scaler, memory."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from p2p_diloco.errors import ConfigError

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(spec: str) -> torch.device:
    """The torch device for --device (auto: CUDA when present, else CPU); a one-line error when it is absent."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {spec}: this torch has no CUDA device (torch {torch.__version__}); use cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {spec}: only {torch.cuda.device_count()} CUDA devices are visible")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"--device {spec}: MPS is not available on this machine; use cpu")
    return device


def resolve_precision(spec: str, device: torch.device) -> str:
    """fp32, bf16 or fp16 for --precision on `device` (auto: bf16 on a GPU that supports it, else fp32)."""
    if spec == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return "bf16"
        return "fp32"
    if spec == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"--precision bf16: {torch.cuda.get_device_name(device)} has no bf16; use fp16 or fp32")
    return spec


@dataclass
class Precision:
    """Autocast for the forward pass and, for fp16, a gradient scaler for the backward pass."""

    name: str
    device: torch.device

    def __post_init__(self) -> None:
        self.dtype = DTYPES[self.name]
        self.scaler = torch.amp.GradScaler(self.device.type) if self.name == "fp16" else None

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Run the forward pass (and loss) in this precision; fp32 runs as is."""
        if self.dtype is None:
            yield
            return
        with torch.autocast(device_type=self.device.type, dtype=self.dtype):
            yield


def memory_gb(device: torch.device) -> float | None:
    """Peak GPU memory this process allocated on `device` (None off CUDA)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 1e9


def host_buffer(numel: int, device: torch.device) -> torch.Tensor:
    """An fp32 CPU vector for the outer state; pinned when the model is on CUDA, so copies run asynchronously."""
    return torch.empty(numel, dtype=torch.float32, pin_memory=device.type == "cuda")
