"""Streaming DiLoCo's fragments: which parameters sync together, and in which outer step.

The model is cut into P fragments of strided layer groups (transformer block i goes to fragment i mod P) and the
remaining tensors (embeddings, final norm, head) go, largest first, to whichever fragment is smallest, so the
fragments stay balanced. Outer step s syncs fragment s mod P: every island on the same outer step sends the same
fragment, only one fragment is in flight at a time, and each fragment syncs once every P outer steps.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

_BLOCK = re.compile(r"(?:^|\.)(?:blocks|layers|h)\.(\d+)\.")


class FragmentError(ValueError):
    """A fragment count the model cannot be split into."""


@dataclass(frozen=True)
class Fragment:
    """One fragment: flat indices into the flattened parameters, and the sizes of the tensors it holds."""

    index: torch.Tensor
    """Sorted flat positions of this fragment's values (int64)."""
    tensor_sizes: tuple[int, ...]
    """Element counts of its tensors, in module order (for per-tensor merges such as RDA)."""

    @property
    def size(self) -> int:
        """Number of values in the fragment."""
        return int(self.index.numel())


def fragment_layout(model: nn.Module, count: int) -> list[Fragment]:
    """Split the model's parameters into `count` balanced fragments of strided layer groups."""
    named = list(model.named_parameters())
    if count < 1:
        raise FragmentError(f"fragments must be >= 1, got {count}")
    blocks = sorted({int(m.group(1)) for name, _ in named if (m := _BLOCK.search(name))})
    units = len(blocks) + sum(1 for name, _ in named if not _BLOCK.search(name))
    if units < count:
        raise FragmentError(
            f"the model has {units} layer blocks and other tensors, fewer than the {count} fragments asked for; "
            f"use --fragments {units} or fewer"
        )
    owner: dict[int, int] = {}
    load = [0] * count
    for position, (name, parameter) in enumerate(named):
        if (match := _BLOCK.search(name)) is not None:
            owner[position] = blocks.index(int(match.group(1))) % count
            load[owner[position]] += parameter.numel()
    rest = sorted((p for p in range(len(named)) if p not in owner), key=lambda p: (-named[p][1].numel(), p))
    for position in rest:
        owner[position] = min(range(count), key=lambda f: (load[f], f))
        load[owner[position]] += named[position][1].numel()

    ranges: list[list[torch.Tensor]] = [[] for _ in range(count)]
    sizes: list[list[int]] = [[] for _ in range(count)]
    offset = 0
    for position, (_, parameter) in enumerate(named):
        fragment = owner[position]
        ranges[fragment].append(torch.arange(offset, offset + parameter.numel(), dtype=torch.int64))
        sizes[fragment].append(parameter.numel())
        offset += parameter.numel()
    return [Fragment(torch.cat(r) if r else torch.empty(0, dtype=torch.int64), tuple(s)) for r, s in zip(ranges, sizes)]


def fragment_for_step(outer_step: int, count: int) -> int:
    """The fragment that outer step `outer_step` syncs (the staggered schedule)."""
    return outer_step % count
