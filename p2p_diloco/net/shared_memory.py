"""Shared-memory tensors that survive a freeze of the island while torch's shared-memory manager starts.

hivemind shares tensors with its averager process under torch's 'file_system' strategy, which starts a
`torch_shm_manager` process on first use and waits for its answer with a timeout. An island frozen in that window
(SIGSTOP, a laptop's sleep; its manager, in its process group, frozen with it) woke to "Shared memory manager
connection has timed out" and its whole start-up failed (benchmarks/chaos.py's smoke run in CI: a freeze 7 s into
the start of a loaded machine). The manager is up by then, so asking again succeeds.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

ATTEMPTS = 3
MANAGER_TIMEOUT = "Shared memory manager connection has timed out"


def shared_zeros(size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor of `size` zeros in shared memory, asking torch's shared-memory manager again when it timed out."""
    tensor = torch.zeros(size, dtype=dtype)
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return tensor.share_memory_()
        except RuntimeError as error:
            if MANAGER_TIMEOUT not in str(error) or attempt == ATTEMPTS:
                raise
            logger.warning(f"torch's shared-memory manager did not answer in time (attempt {attempt}); asking again")
    raise AssertionError("unreachable")
