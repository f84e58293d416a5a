"""A shared-memory tensor survives torch's shared-memory manager timing out once (an island frozen as it started)."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.net.shared_memory import ATTEMPTS, MANAGER_TIMEOUT, shared_zeros


def _failing(times: int, message: str = MANAGER_TIMEOUT):
    real = torch.Tensor.share_memory_
    calls = []

    def share_memory_(tensor: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) <= times:
            raise RuntimeError(f"{message}\nException raised from recv at socket.h:67")
        return real(tensor)

    return share_memory_, calls


def test_a_manager_timeout_is_asked_again_and_the_tensor_is_shared(monkeypatch) -> None:
    share, calls = _failing(ATTEMPTS - 1)
    monkeypatch.setattr(torch.Tensor, "share_memory_", share)
    tensor = shared_zeros(8)
    assert tensor.is_shared() and len(calls) == ATTEMPTS and torch.equal(tensor, torch.zeros(8))


def test_a_manager_that_never_answers_and_other_errors_still_raise(monkeypatch) -> None:
    share, calls = _failing(ATTEMPTS)
    monkeypatch.setattr(torch.Tensor, "share_memory_", share)
    with pytest.raises(RuntimeError, match="timed out"):
        shared_zeros(8)
    assert len(calls) == ATTEMPTS
    other, once = _failing(1, "No space left on device")
    monkeypatch.setattr(torch.Tensor, "share_memory_", other)
    with pytest.raises(RuntimeError, match="No space left"):
        shared_zeros(8)
    assert len(once) == 1  # not a manager timeout: not asked again
