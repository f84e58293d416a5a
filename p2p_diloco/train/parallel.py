"""A model shared by the ranks of one island: DDP or FSDP2, whole parameters in and out, sharded checkpoints.

With DDP every rank holds the whole model and gradients are averaged in the backward pass. With FSDP2
(`fully_shard`) each rank holds a shard of every parameter as a DTensor, so reading or writing a whole parameter is
a collective: every rank must call these functions in the same order.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

SyncContext = Callable[[bool], contextlib.AbstractContextManager]
"""sync(last): the context of one micro-batch's backward; only the last one of a step all-reduces gradients."""


def wrap_model(model: nn.Module, parallel: str, device: torch.device) -> tuple[nn.Module, SyncContext | None]:
    """The module the inner loop runs (DDP, or the model itself once fully_shard-ed) and its micro-batch context."""
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # Buffers (masks, rotary tables) are the same on every rank: no broadcast in every forward.
        no_buffer_sync = (
            {"forward_sync_buffers": False}
            if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
            else {"broadcast_buffers": False}
        )
        wrapped = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, **no_buffer_sync
        )
        return wrapped, lambda last: contextlib.nullcontext() if last else wrapped.no_sync()
    from torch.distributed.fsdp import fully_shard

    for blocks in [module for module in model.modules() if isinstance(module, nn.ModuleList)]:
        for block in blocks:  # one all-gather per transformer block: peak memory is one block, not the model
            fully_shard(block)
    fully_shard(model)
    return model, None


def is_sharded(parameter: torch.Tensor) -> bool:
    """True for an FSDP2 parameter (a DTensor holding this rank's shard)."""
    from torch.distributed.tensor import DTensor

    return isinstance(parameter, DTensor)


@torch.no_grad()
def whole_parameters(model: nn.Module) -> Iterator[torch.Tensor]:
    """Every parameter whole, one at a time (for FSDP an all-gather each: memory stays one parameter)."""
    for parameter in model.parameters():
        yield parameter.full_tensor() if is_sharded(parameter) else parameter.detach()


@torch.no_grad()
def load_whole(parameter: torch.Tensor, value: torch.Tensor | None) -> None:
    """Write a whole parameter's `value` (rank 0's; None on the other ranks of a sharded model) into `parameter`."""
    if not is_sharded(parameter):
        parameter.copy_(value.view_as(parameter), non_blocking=True)
        return
    from torch.distributed.tensor import distribute_tensor

    mesh = parameter.device_mesh
    source = torch.empty(parameter.shape, dtype=parameter.dtype, device=parameter.to_local().device)
    if value is not None:
        source.copy_(value.view(parameter.shape))
    # Rank 0 scatters its copy: each rank receives only its own shard.
    parameter.copy_(distribute_tensor(source, mesh, parameter.placements, src_data_rank=0))


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Every rank writes its shards of the model and the inner optimizer (torch.distributed.checkpoint)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(directory))


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Read shards written by `save_sharded`, resharded by DCP when the island now has a different rank count."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)  # also creates AdamW's state to load into
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
