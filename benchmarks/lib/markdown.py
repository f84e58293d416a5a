"""Markdown tables for BENCHMARKS.md (benchmarks/report.py and its section renderers)."""

from __future__ import annotations


def fmt(value: object, digits: int = 4) -> str:
    """A table cell: floats to `digits` decimals, None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(header: list[str], rows: list[list[object]]) -> str:
    """A markdown table of `rows` under `header`."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
