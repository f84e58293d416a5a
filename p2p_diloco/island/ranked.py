"""An island of several ranks: rank 0 runs the island and talks to the swarm, every other rank follows it.

Rank 0's trainer (`LeaderTrainer`) announces each operation that involves all ranks before it runs it; the other
ranks (`follow`) run the same operation on their own slice or shard. Between islands nothing changes: the swarm
sees one peer, rank 0, whose pseudo-gradient is the island's (DDP ranks hold identical weights; FSDP shards are
gathered one parameter at a time) and whose every outer step reaches the ranks through `load_all`.
"""

from __future__ import annotations

import atexit
import faulthandler
import logging
import os
import shutil
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from p2p_diloco.config import PeerConfig
from p2p_diloco.diloco.inner import InnerResult
from p2p_diloco.errors import UserError
from p2p_diloco.files import fsync_dir
from p2p_diloco.island.ranks import LOST_RANKS_EXIT, Command, RankGroup
from p2p_diloco.island.trainer import LocalTrainer
from p2p_diloco.process import die_with_parent, ignore_group_stop_signals
from p2p_diloco.signals import GracefulStop, Stopped
from p2p_diloco.train.parallel import load_whole, save_sharded, whole_parameters

logger = logging.getLogger(__name__)

RANK_STOP_S = 10.0
"""Rank 0 gets this long to stop cleanly after a signal. The launcher also signals it when another rank died, and
then the round's collectives can block: checkpoints are atomic, so exiting at once loses at most that round."""
COLLECTIVE_ERRORS = ("gloo", "NCCL", "Connection reset", "Connection closed")
"""Words of the RuntimeErrors (not DistErrors) that a collective raises when another rank is gone, e.g. in DDP's
backward pass."""
SHARD_FOLDERS_KEPT = 3
"""Sharded inner states kept: those of the two checkpoints kept, and the one being written."""


def shard_folder(checkpoint_dir: str, step: int) -> Path:
    """Where the ranks write the sharded inner state of outer step `step`."""
    return Path(checkpoint_dir) / f"inner-{step:08d}"


class LeaderTrainer(LocalTrainer):
    """Rank 0's trainer: every operation that needs the other ranks is announced to them first."""

    def __init__(self, config: PeerConfig, ranks: RankGroup):
        super().__init__(config, ranks=ranks)
        self.sharded = ranks.parallel == "fsdp"

    def open_stream(self, peer_id: str) -> None:
        """Open the island's stream on every rank, seeded by rank 0's peer id."""
        self.ranks.send(Command.OPEN_STREAM)
        self.ranks.share(peer_id)
        super().open_stream(peer_id)

    def train(self, steps: int, should_stop: Callable[[], bool] | None = None) -> InnerResult:
        """All ranks run `steps` inner steps. A stop waits for the round's end: ranks must run the same steps."""
        if steps <= 0:
            return InnerResult([], 0, 0.0)
        self.ranks.send(Command.TRAIN, steps)
        return super().train(steps)

    def weights(self) -> torch.Tensor:
        """The island's weights (FSDP: gathered from every rank's shards, one parameter at a time)."""
        if self.sharded:
            self.ranks.send(Command.GATHER)
        return super().weights()

    def load_all(self, anchor: torch.Tensor) -> None:
        """Load the anchor into every rank's model."""
        self.ranks.send(Command.LOAD)
        super().load_all(anchor)
        if not self.sharded:
            broadcast_parameters(self.model)

    def evaluate(self) -> float:
        """The eval loss (FSDP: every rank runs the sharded forward passes with rank 0)."""
        if self.sharded:
            self.ranks.send(Command.EVALUATE)
        return super().evaluate()

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """What resumes local training; FSDP's inner optimizer is written by every rank as shards beside it."""
        state = super().state_dict()
        if not self.sharded or step is None or not self.config.checkpoint_dir:
            return state
        self.ranks.send(Command.SAVE_SHARDS, step)
        folder = shard_folder(self.config.checkpoint_dir, step)
        self.ranks.share(str(folder))
        write_shards(self, folder)
        prune_shard_folders(Path(self.config.checkpoint_dir))
        del state["inner_optimizer"]
        state["inner_shards"] = folder.name
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume local training on every rank from rank 0's checkpoint."""
        self.ranks.send(Command.LOAD_STATE)
        local = {key: value for key, value in state.items() if key in LOCAL_STATE_KEYS}
        self.ranks.share(local)
        super().load_state_dict(local)

    def close(self) -> None:
        """Tell the other ranks the island is done, and wait until they all heard it."""
        self.ranks.send(Command.STOP)
        self.ranks.barrier()  # tearing the group down while a rank still reads from it can abort the process


LOCAL_STATE_KEYS = (
    "inner_optimizer",
    "inner_shards",
    "scheduler",
    "stream",
    "inner_steps_total",
    "tokens",
    "grad_scaler",
)
"""The parts of a checkpoint that every rank loads (the outer state stays on rank 0)."""


@torch.no_grad()
def broadcast_parameters(model: torch.nn.Module) -> None:
    """DDP: rank 0's parameters into every rank's, one parameter at a time (no extra copy of the model)."""
    for parameter in model.parameters():
        dist.broadcast(parameter.data, src=0)


def write_shards(trainer: LocalTrainer, folder: Path) -> None:
    """Every rank writes its shards into a scratch folder; rank 0 renames it into place once all have written."""
    scratch = folder.with_name(folder.name + ".partial")
    if trainer.ranks.leader and scratch.exists():
        shutil.rmtree(scratch)
    trainer.ranks.barrier()
    save_sharded(trainer.model, trainer.optimizer, scratch)
    trainer.ranks.barrier()
    if trainer.ranks.leader:
        if folder.exists():
            shutil.rmtree(folder)
        scratch.rename(folder)
        fsync_dir(folder.parent)


def prune_shard_folders(directory: Path) -> None:
    """Keep the newest SHARD_FOLDERS_KEPT sharded inner states."""
    folders = sorted(path for path in directory.glob("inner-*") if path.is_dir() and path.suffix != ".partial")
    for old in folders[:-SHARD_FOLDERS_KEPT]:
        shutil.rmtree(old, ignore_errors=True)


def follow(config: PeerConfig, ranks: RankGroup) -> None:
    """A rank other than 0: build the same trainer, then run rank 0's commands until it says stop."""
    trainer = LocalTrainer(config, ranks=ranks)
    while True:
        command, argument = ranks.receive()
        if command is Command.STOP:
            ranks.barrier()
            return
        if command is Command.OPEN_STREAM:
            trainer.open_stream(ranks.share())
        elif command is Command.TRAIN:
            trainer.train(argument)
        elif command is Command.LOAD:
            receive_weights(trainer)
        elif command is Command.GATHER:
            for _ in whole_parameters(trainer.model):
                pass  # the all-gathers rank 0 reads the island's weights from
        elif command is Command.EVALUATE:
            trainer.evaluate()
        elif command is Command.SAVE_SHARDS:
            write_shards(trainer, Path(ranks.share()))
        elif command is Command.LOAD_STATE:
            trainer.load_state_dict(ranks.share())


def receive_weights(trainer: LocalTrainer) -> None:
    """Take rank 0's newly loaded weights: a broadcast per parameter (DDP) or this rank's shard of it (FSDP)."""
    if trainer.ranks.parallel == "ddp":
        broadcast_parameters(trainer.model)
        return
    for parameter in trainer.model.parameters():
        load_whole(parameter, None)


def run_ranked_island(config: PeerConfig, stop: GracefulStop) -> NoReturn:
    """Run this rank's part of a multi-process island (started by torchrun or `peer --nproc-per-node`), then exit."""
    island = config.island
    die_with_parent()  # a launcher killed outright must not leave its ranks (and rank 0's daemons) behind
    # A rank aborted by native code (gloo, NCCL: "terminate called ...") otherwise dies without a Python stack.
    faulthandler.enable(all_threads=True)
    ranks = RankGroup.from_environment(island.parallel, config.train.device, island.rank_timeout_s)
    torch.set_num_threads(config.train.threads)
    stop.hard_after_s = RANK_STOP_S
    broken = True  # until the island ends normally or with a one-line user error
    try:
        if not ranks.leader:
            # Stops are rank 0's to decide (at the end of a round); a follower that left early would hang it.
            ignore_group_stop_signals()
            logging.getLogger("p2p_diloco").setLevel(max(logging.WARNING, logging.getLogger().level))
            follow(config, ranks)
            broken = False
            ranks.close()
            exit_at_once(0)
        from p2p_diloco.island.island import Island

        trainer = LeaderTrainer(config, ranks)
        logger.info(f"island of {ranks.world} ranks ({ranks.parallel}, {ranks.backend}); rank 0 talks to the swarm")
        Island(config, stop=stop, trainer=trainer).run()
        trainer.close()
        broken = False
        ranks.close()
        stop.report_checkpoint_kept()
        exit_at_once(stop.exit_code)
    except UserError:
        broken = False  # the island refused to start (a one-line error follows): leave the group cleanly
        raise
    except (dist.DistError, RuntimeError) as error:
        if not isinstance(error, dist.DistError) and not any(word in str(error) for word in COLLECTIVE_ERRORS):
            traceback.print_exc()
            leave_now(f"rank {ranks.rank} failed (the traceback above)", 1)
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        leave_now(f"rank {ranks.rank}: lost the island's other ranks ({first_line})", LOST_RANKS_EXIT)
    except Stopped as stopped:
        leave_now(f"rank {ranks.rank}: stopped by {stopped}", stopped.exit_code)
    except Exception:
        traceback.print_exc()
        leave_now(f"rank {ranks.rank} failed (the traceback above)", 1)
    finally:
        if not broken:
            ranks.close()


def exit_at_once(code: int) -> NoReturn:
    """End a rank that finished cleanly and left its group, skipping the interpreter's native teardown.

    Torch 2.13's gloo can abort or segfault in its static destructors at exit (2 in 12 runs here: "terminate
    called without an active exception", no Python frame), failing an island whose work was done and saved.
    Python's own exit handlers still run (`atexit._run_exitfuncs`: private, but the only way to run them before
    `os._exit`; they remove temporary identity folders).
    """
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def leave_now(message: str, code: int) -> NoReturn:
    """Exit at once, for a rank whose island is broken or was stopped outside a safe point.

    Tearing down a process group with a dead peer, or joining the threads of an averager cut off mid-round, can
    block; checkpoints are atomic and rank 0's DHT process and p2pd die with it (PDEATHSIG), so nothing is lost.
    """
    print(f"p2p-diloco peer: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)
