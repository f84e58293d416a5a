"""Streaming DiLoCo's fragments: which parameters sync together, and in which outer step.

Two layouts. 'strided' (Streaming DiLoCo): transformer block i goes to fragment i mod P and the remaining tensors
(embeddings, final norm, head) go, largest first, to whichever fragment is smallest. 'balanced' (Decoupled DiLoCo's
balanced tensor fragmentation): every tensor, largest first, goes to the fragment that is smallest so far, a greedy
bin-packing whose largest fragment (the peak bytes of one outer step) is at most 4/3 of the best possible. Outer
step s syncs fragment s mod P: every island on the same outer step sends the same fragment, only one fragment is
in flight at a time, and each fragment syncs once every P outer steps.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

_BLOCK = re.compile(r"(?:^|\.)(?:blocks|layers|h)\.(\d+)\.")
LAYOUTS = ("strided", "balanced")


class FragmentError(ValueError):
    """A fragment count the model cannot be split into."""


@dataclass(frozen=True)
class Fragment:
    """One fragment of the flattened parameters: which values, and the sizes of the tensors it holds.

    The whole model is the single fragment of a layout of one (`whole`); its index is `slice(None)`, so taking
    it is a view of the flat vector rather than a gather.
    """

    number: int
    """Position in the layout, 0..count-1."""
    count: int
    """P, the number of fragments in the layout."""
    index: torch.Tensor | slice
    """Sorted flat positions of this fragment's values (int64), or slice(None) for the whole model."""
    tensor_sizes: tuple[int, ...]
    """Element counts of its tensors, in module order (for per-tensor merges such as RDA)."""
    size: int
    """Number of values in the fragment."""

    @property
    def whole(self) -> bool:
        """True for the whole model (a layout of one fragment)."""
        return self.count == 1

    @property
    def label(self) -> int | None:
        """What metrics and matchmaking call this fragment: its number, or None for the whole model."""
        return None if self.whole else self.number

    def take(self, flat: torch.Tensor) -> torch.Tensor:
        """This fragment's values of a flat vector (a view for the whole model, else a copy)."""
        return flat[self.index]

    def put(self, flat: torch.Tensor, values: torch.Tensor) -> None:
        """Write this fragment's values into a flat vector."""
        flat[self.index] = values


def fragment_layout(model: nn.Module, count: int, layout: str = "strided") -> list[Fragment]:
    """Split the model's parameters into `count` fragments: strided layer groups, or balanced tensor bins."""
    named = list(model.named_parameters())
    if count < 1:
        raise FragmentError(f"fragments must be >= 1, got {count}")
    if layout not in LAYOUTS:
        raise FragmentError(f"unknown fragment layout {layout!r}; use one of {', '.join(LAYOUTS)}")
    if count == 1:
        sizes = tuple(parameter.numel() for _, parameter in named)
        return [Fragment(0, 1, slice(None), sizes, sum(sizes))]
    owner = _strided_owners(named, count) if layout == "strided" else _balanced_owners(named, count)
    return _fragments(named, owner, count)


def _balanced_owners(named: list[tuple[str, nn.Parameter]], count: int) -> dict[int, int]:
    """Longest-processing-time bin-packing of whole tensors: largest first, each into the lightest fragment."""
    if len(named) < count:
        raise FragmentError(f"the model has {len(named)} tensors, fewer than {count} fragments; use fewer")
    owner: dict[int, int] = {}
    load = [0] * count
    for position in sorted(range(len(named)), key=lambda p: (-named[p][1].numel(), p)):
        owner[position] = min(range(count), key=lambda f: (load[f], f))
        load[owner[position]] += named[position][1].numel()
    return owner


def _strided_owners(named: list[tuple[str, nn.Parameter]], count: int) -> dict[int, int]:
    """Block i to fragment i mod P, then the other tensors, largest first, to the lightest fragment."""
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
    return owner


def _fragments(named: list[tuple[str, nn.Parameter]], owner: dict[int, int], count: int) -> list[Fragment]:
    """The fragments of an assignment of tensors (by position) to fragment numbers."""
    ranges: list[list[torch.Tensor]] = [[] for _ in range(count)]
    sizes: list[list[int]] = [[] for _ in range(count)]
    offset = 0
    for position, (_, parameter) in enumerate(named):
        fragment = owner[position]
        ranges[fragment].append(torch.arange(offset, offset + parameter.numel(), dtype=torch.int64))
        sizes[fragment].append(parameter.numel())
        offset += parameter.numel()
    return [
        Fragment(number, count, torch.cat(r) if r else torch.empty(0, dtype=torch.int64), tuple(s), sum(s))
        for number, (r, s) in enumerate(zip(ranges, sizes))
    ]


def fragment_for_step(outer_step: int, count: int) -> int:
    """The number of the fragment that outer step `outer_step` syncs (the staggered schedule)."""
    return outer_step % count
