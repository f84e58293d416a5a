"""Summary table and loss plot of several islands' metrics, for the local-swarm demo."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass
class IslandSummary:
    """What one island did over a run, from its metrics records."""

    name: str
    peer_id: str
    outer_steps: int
    first_loss: float | None
    last_loss: float | None
    first_eval_loss: float | None
    last_eval_loss: float | None
    mean_partners: float
    mean_wait_s: float
    tokens: int


def _values(records: list[dict], key: str) -> list[float]:
    """The non-None numeric values of `key`, in record order."""
    return [float(r[key]) for r in records if r.get(key) is not None]


def _mean(values: list[float]) -> float:
    """Arithmetic mean, 0.0 for no values so an empty island still gets a row."""
    return sum(values) / len(values) if values else 0.0


def summarize(metrics_by_island: dict[str, list[dict]]) -> list[IslandSummary]:
    """One IslandSummary per island, in the order of the mapping."""
    summaries = []
    for name, records in metrics_by_island.items():
        losses = _values(records, "loss")
        eval_losses = _values(records, "eval_loss")
        tokens = _values(records, "tokens")
        summaries.append(
            IslandSummary(
                name=name,
                peer_id=str(next((r["peer_id"] for r in reversed(records) if r.get("peer_id")), "")),
                # Distinct steps: a resume from checkpoint can record the same outer step twice.
                outer_steps=len({r.get("outer_step") for r in records}),
                first_loss=losses[0] if losses else None,
                last_loss=losses[-1] if losses else None,
                first_eval_loss=eval_losses[0] if eval_losses else None,
                last_eval_loss=eval_losses[-1] if eval_losses else None,
                mean_partners=_mean(_values(records, "partners")),
                mean_wait_s=_mean(_values(records, "wait_s")),
                # `tokens` is cumulative per island, so the total is the largest value seen.
                tokens=int(max(tokens)) if tokens else 0,
            )
        )
    return summaries


def _fmt(value: float | None, digits: int = 4) -> str:
    """A number for the table, '-' for missing."""
    return "-" if value is None else f"{value:.{digits}f}"


def format_summary(summaries: list[IslandSummary]) -> str:
    """Aligned text table, one row per island: steps, first/last loss, first/last eval, partners, wait."""
    header = [
        "island",
        "outer steps",
        "first loss",
        "last loss",
        "first eval",
        "last eval",
        "mean partners",
        "mean wait s",
    ]
    rows = [
        [
            s.name,
            str(s.outer_steps),
            _fmt(s.first_loss),
            _fmt(s.last_loss),
            _fmt(s.first_eval_loss),
            _fmt(s.last_eval_loss),
            _fmt(s.mean_partners, 2),
            _fmt(s.mean_wait_s, 2),
        ]
        for s in summaries
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        # Name left-aligned, numbers right-aligned so decimal points line up.
        first = cells[0].ljust(widths[0])
        rest = [cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest]).rstrip()

    separator = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), separator, *(line(r) for r in rows)])


def plot_losses(metrics_by_island: dict[str, list[dict]], path: str | os.PathLike, title: str = "p2p-diloco") -> Path:
    """Saves a PNG with train loss and eval loss against inner_steps_total, one line per island."""
    # Figure + Agg canvas instead of pyplot: no display needed and no global backend switched under callers.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(12, 4.5))
    FigureCanvasAgg(fig)
    ax_train, ax_eval = fig.subplots(1, 2)
    for ax, key, label in ((ax_train, "loss", "train loss"), (ax_eval, "eval_loss", "eval loss")):
        for name, records in metrics_by_island.items():
            points = [
                (r["inner_steps_total"], r[key])
                for r in records
                if r.get("inner_steps_total") is not None and r.get(key) is not None
            ]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", markersize=3, label=name)
        ax.set_title(label)
        ax.set_xlabel("inner steps (total)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    return path
