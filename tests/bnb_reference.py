"""bitsandbytes as the tests' reference for the int8 format, imported without its Hugging Face Hub kernel request."""

from __future__ import annotations

import logging
import sys
from types import ModuleType


def bitsandbytes_functional() -> ModuleType:
    """`bitsandbytes.functional`, with the `kernels` package hidden while it imports.

    Its CPU backend asks the Hub for an optional 4-bit kernel at import (`kernels.get_kernel`): a network request tests
    must never make, for a kernel these checks never call. With the package hidden, bitsandbytes takes its fallback.
    """
    hidden = "kernels" not in sys.modules
    if hidden:
        sys.modules["kernels"] = None  # type: ignore[assignment]  # `from kernels import ...` raises ImportError
    cpu_ops_log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = cpu_ops_log.level
    cpu_ops_log.setLevel(logging.ERROR)
    try:
        import bitsandbytes.functional as functional
    finally:
        cpu_ops_log.setLevel(level)
        if hidden:
            sys.modules.pop("kernels", None)
    return functional
