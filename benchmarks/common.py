"""What every benchmark records about the machine it ran on."""

from __future__ import annotations

import os
import platform


def machine() -> dict:
    """Platform, Python, torch, CPU count and memory: enough to tell two result files' machines apart."""
    import psutil
    import torch

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 1e9, 1),
    }
