"""How big the parts of an all-reduce are: about PARTS_PER_REDUCER parts for each reducer of the group.

Every part costs a message, a reply and a step of the reducers' lockstep, in Python: with hivemind's fixed 512 KiB
parts, 50M fp32 values among 4 peers made ~100 parts per reducer and a round took 1.46 s on loopback; 6 parts per
reducer took 1.07 s (benchmarks/exchange.py --part-size). A handful per reducer still lets a sender's next part
travel while the reducer adds the last one. Every member computes the same size from what the whole group shares
(the vector's size, the group's size and the codec), so members cut the vector alike.
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


def part_size_for(tensors: Sequence[torch.Tensor], group_size: int, compression: CompressionBase) -> int:
    """Bytes per part on the wire (hivemind's part_size_bytes, counted after compression) for this group."""
    total = sum(tensor.numel() for tensor in tensors)
    values = min(MAX_PART_VALUES, max(MIN_PART_VALUES, math.ceil(total / (max(1, group_size) * PARTS_PER_REDUCER))))
    first = tensors[0]
    ratio = compression.estimate_compression_ratio(CompressionInfo.from_tensor(first, key=0))
    return max(1, int(values * first.element_size() * ratio))
