"""Experiment trackers beside the JSONL metrics: TensorBoard scalars and, optionally, Weights & Biases.

Every numeric field of a round's record (bools and lists left out) becomes a scalar at step = outer step, tagged
with the island's peer id, so several islands' curves overlay in one TensorBoard or one W&B project.
"""

from __future__ import annotations

import math
from typing import Any

from p2p_diloco.errors import ConfigError

SKIPPED = ("outer_step", "time", "start_outer_step")
"""Numbers that are the step or a timestamp, not a measurement."""


def numeric_fields(record: dict[str, Any]) -> dict[str, float]:
    """The record's finite numbers by name (the step and timestamps left out)."""
    return {
        key: float(value)
        for key, value in record.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in SKIPPED
        if math.isfinite(value)
    }


class TensorBoardTracker:
    """Scalars in a TensorBoard event file under `folder/<peer id>`."""

    def __init__(self, folder: str):
        from torch.utils.tensorboard import SummaryWriter

        self.folder, self.writer_class, self.writer = folder, SummaryWriter, None

    def log(self, record: dict[str, Any]) -> None:
        """Write one round's numbers."""
        if self.writer is None:  # the peer id is known from the first record on
            self.writer = self.writer_class(log_dir=f"{self.folder}/{record.get('peer_id', 'island')}")
        step = int(record.get("outer_step", 0))
        for key, value in numeric_fields(record).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        if self.writer is not None:
            self.writer.close()


class WandbTracker:
    """A Weights & Biases run in `project`, one per island (WANDB_MODE=offline works without a network)."""

    def __init__(self, project: str):
        try:
            import wandb
        except ImportError:
            raise ConfigError("--wandb needs the wandb package: pip install 'p2p-diloco[wandb]'") from None
        self.wandb, self.project, self.run = wandb, project, None

    def log(self, record: dict[str, Any]) -> None:
        """Log one round's numbers."""
        if self.run is None:
            name = str(record.get("peer_id", "island"))
            self.run = self.wandb.init(project=self.project, name=name, group=str(record.get("run_id")), reinit=True)
        self.run.log(numeric_fields(record), step=int(record.get("outer_step", 0)))

    def close(self) -> None:
        """Finish the run (writes the offline run folder)."""
        if self.run is not None:
            self.run.finish()


def trackers(tensorboard: str | None, wandb: str | None) -> list:
    """The trackers the config asks for."""
    chosen: list = []
    if tensorboard:
        chosen.append(TensorBoardTracker(tensorboard))
    if wandb:
        chosen.append(WandbTracker(wandb))
    return chosen
