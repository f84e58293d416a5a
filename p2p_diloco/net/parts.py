"""How big the parts of an all-reduce are: few enough to keep Python's per-part costs small on fast links, small
enough that filling and draining the pipeline stays short on slow ones.

Every part costs a message, a reply and a step of the reducers' lockstep: with hivemind's fixed 512 KiB parts,
50M fp32 values among 4 peers made ~100 parts per reducer and a round took 1.46 s on loopback; 6 parts per reducer
took 1.07 s (benchmarks/exchange.py --part-size). On a 100 Mbit/s link the opposite holds: a reducer answers part p
only once it holds everyone's part p, so a round pays about two parts' transfer time on top of its bytes (2.5 MB
parts made 2 islands 1.29x bytes/bandwidth, 512 KiB parts 1.12x, benchmarks/link.py). So a part is at most 1/8 of a
reducer's share and at most what the slowest member moved in PART_SECONDS in its last round (each member gathers
that figure with its metadata). Every member computes the same size from what the whole group shares (the vector's
and the group's size, the codec, the gathered figures), so members cut the vector alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from hivemind.compression import CompressionBase, CompressionInfo

PARTS_PER_REDUCER = 8
MIN_PART_VALUES = 1 << 17
"""Values in the smallest part (512 KiB of fp32, hivemind's default size)."""
MAX_PART_VALUES = 1 << 21
"""Values in the largest part (8 MiB of fp32: 0.7 s at 100 Mbit/s, well inside a 5 s next_chunk_timeout)."""


PART_SECONDS = 0.05
"""Longest transfer time of one part at the slowest member's last measured rate."""
GATHER_KEY = "part_bytes"
"""Gathered metadata: the bytes this member's all-reduce moved in PART_SECONDS in its last round."""


def part_size_for(
    tensors: Sequence[torch.Tensor],
    group_size: int,
    compression: CompressionBase,
    rates: Sequence[object] = (),
) -> int:
    """Bytes per part on the wire (hivemind's part_size_bytes, counted after compression) for this group, given
    the members' gathered GATHER_KEY figures (anything but a positive number is ignored: a peer's word)."""
    total = sum(tensor.numel() for tensor in tensors)
    first = tensors[0]
    bytes_per_value = first.element_size() * compression.estimate_compression_ratio(CompressionInfo.from_tensor(first))
    values = math.ceil(total / (max(1, group_size) * PARTS_PER_REDUCER))
    measured = [rate for rate in rates if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0]
    if measured:
        values = min(values, int(min(measured) / bytes_per_value))
    values = min(MAX_PART_VALUES, max(MIN_PART_VALUES, values))
    return max(1, int(values * bytes_per_value))


def part_bytes_per_window(bytes_sent: float, seconds: float) -> int | None:
    """What this member gathers under GATHER_KEY after a round that sent `bytes_sent` in `seconds` (None: no rate)."""
    if bytes_sent <= 0 or seconds <= 0 or not math.isfinite(bytes_sent / seconds):
        return None
    return int(bytes_sent / seconds * PART_SECONDS)
