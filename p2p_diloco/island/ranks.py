"""The ranks of one island on torch.distributed: who they are, and the commands rank 0 sends the others.

An island of several processes is one member of the swarm. Rank 0 runs the island's loop and alone talks to the
swarm; the other ranks follow it (`p2p_diloco.island.ranked`). Before every operation that involves all ranks
(inner steps, loading weights, a sharded checkpoint) rank 0 broadcasts a small command tensor, so every rank runs
the same collectives in the same order.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from p2p_diloco.errors import ConfigError

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What torch's elastic launcher (torchrun, or `peer --nproc-per-node`) sets in every rank's environment."""
# A rank that exits only because another rank broke the island; the launcher names the other rank instead.
LOST_RANKS_EXIT = 75


class Command(enum.IntEnum):
    """What rank 0 asks the other ranks to do next."""

    STOP = 0
    OPEN_STREAM = 1
    TRAIN = 2
    LOAD = 3
    GATHER = 4
    EVALUATE = 5
    SAVE_SHARDS = 6
    LOAD_STATE = 7


def launched_as_rank() -> bool:
    """True inside a process started by torch's elastic launcher."""
    return all(name in os.environ for name in LAUNCHER_ENV)


@dataclass
class RankGroup:
    """This process's place in its island's process group."""

    rank: int
    world: int
    local_rank: int
    parallel: str
    """'ddp' or 'fsdp' (config island.parallel)."""
    device: torch.device
    """Where this rank trains: cuda:LOCAL_RANK with NCCL, else the CPU with gloo."""

    @property
    def leader(self) -> bool:
        """True on rank 0, the one rank that talks to the swarm."""
        return self.rank == 0

    @property
    def backend(self) -> str:
        """The collective backend: NCCL on CUDA, gloo on CPU."""
        return "nccl" if self.device.type == "cuda" else "gloo"

    @classmethod
    def from_environment(cls, parallel: str, device_spec: str, timeout_s: float) -> RankGroup:
        """Join the island's process group that the launcher's environment describes."""
        rank, world, local_rank = (int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        wants_cuda = device_spec.startswith("cuda") or (device_spec == "auto" and torch.cuda.is_available())
        device = torch.device("cuda", local_rank) if wants_cuda else torch.device("cpu")
        if wants_cuda:
            if local_rank >= torch.cuda.device_count():
                raise ConfigError(
                    f"rank {rank} (local rank {local_rank}) has no GPU: this machine shows "
                    f"{torch.cuda.device_count()}; lower --nproc-per-node or set CUDA_VISIBLE_DEVICES"
                )
            torch.cuda.set_device(device)
        group = cls(rank, world, local_rank, parallel, device)
        if not dist.is_initialized():
            timeout = timedelta(seconds=timeout_s)
            store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
            # Keys of this attempt only: after a restart in place (--max-restarts) the launcher's store still
            # holds the dead ranks' gloo addresses, and a new rank that read one would dial a closed port.
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"p2p_diloco/attempt_{attempt}", store)
            dist.init_process_group(group.backend, store=store, rank=rank, world_size=world, timeout=timeout)
        return group

    # ----- rank 0 speaks, the others listen ------------------------------------------------------------------
    def send(self, command: Command, argument: int = 0) -> None:
        """Rank 0: tell the other ranks what comes next."""
        dist.broadcast(torch.tensor([int(command), argument], dtype=torch.int64, device=self.device), src=0)

    def receive(self) -> tuple[Command, int]:
        """Every other rank: wait for rank 0's next command."""
        message = torch.zeros(2, dtype=torch.int64, device=self.device)
        dist.broadcast(message, src=0)
        command, argument = message.tolist()
        return Command(command), argument

    def share(self, value: Any = None) -> Any:
        """Rank 0's `value` (any picklable object), on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=0, device=self.device if self.backend == "nccl" else None)
        return box[0]

    def barrier(self) -> None:
        """Wait until every rank got here."""
        dist.barrier(device_ids=[self.local_rank] if self.backend == "nccl" else None)

    def close(self) -> None:
        """Leave the process group."""
        if dist.is_initialized():
            dist.destroy_process_group()
