"""Sparse pseudo-gradients (SparseLoCo-style): keep the top-k of each chunk, send positions and low-bit values.

Selection happens on the island, before the all-reduce: `topk_sparsify` keeps the `density` largest magnitudes
of every chunk of CHUNK values and zeroes the rest, and error feedback carries what was left out into the next
round (it is always on with this codec). The wire format (`encode_sparse`) then carries every nonzero of a
vector: positions as LEB128 varints of the gaps between them, values as a sign bit and (bits - 1) bits of
magnitude between the smallest and largest magnitude of each block of 128 nonzeros (two fp32 per block). It
selects nothing itself, so a reducer's weighted mean of contributions with different positions (their union)
travels back with every position it holds: contributions merge exactly, up to the value bits.

    payload: bits u8 | nonzeros u32 | gaps varint[nonzeros] | (low, high) fp32[2 * blocks] | codes

Codes pack 4 (2-bit) or 2 (4-bit) nonzeros per byte, the first in the high bits. A NaN or inf makes its block's
range NaN, so the block decodes to NaN (the strict all-reduce's poison survives re-encoding).
"""

from __future__ import annotations

import struct

import numpy as np
import torch

CHUNK = 4096
"""Top-k is taken per chunk of this many values, so every part of the model keeps its share of the budget."""
VALUE_BLOCK = 128
"""Nonzeros that share one (low, high) magnitude range."""
VALUE_BITS = (2, 4)
_HEAD = struct.Struct("<BI")


def topk_sparsify(values: torch.Tensor, density: float, chunk: int = CHUNK) -> torch.Tensor:
    """`values` (flat) with all but the ceil(density * chunk) largest magnitudes of every chunk set to zero."""
    flat = values.detach().reshape(-1).to(torch.float32)
    numel = flat.numel()
    if numel == 0:
        return flat.clone()
    chunks = -(-numel // chunk)
    padded = torch.zeros(chunks * chunk)
    padded[:numel] = flat
    rows = padded.view(chunks, chunk)
    keep = min(chunk, max(1, int(np.ceil(density * chunk))))
    # NaN first: a poisoned value must not be dropped silently (nan_to_num maps it above every finite value).
    scores = torch.nan_to_num(rows.abs(), nan=float("inf"))
    chosen = scores.topk(keep, dim=1).indices
    sparse = torch.zeros_like(rows)
    sparse.scatter_(1, chosen, rows.gather(1, chosen))
    return sparse.view(-1)[:numel].reshape(values.shape)


def _varints(gaps: np.ndarray) -> bytes:
    """LEB128 of non-negative int64 gaps, vectorised: 7 bits a byte, the high bit set on all but the last."""
    if gaps.size == 0:
        return b""
    lengths = np.ones(gaps.size, dtype=np.int64)
    for bits in (7, 14, 21, 28, 35, 42, 49, 56):
        lengths += gaps >= (1 << bits)
    starts = np.cumsum(lengths) - lengths
    out = np.empty(int(lengths.sum()), dtype=np.uint8)
    for byte in range(int(lengths.max())):
        has = lengths > byte
        more = (lengths[has] > byte + 1).astype(np.uint8) << 7
        out[starts[has] + byte] = ((gaps[has] >> (7 * byte)) & 0x7F).astype(np.uint8) | more
    return out.tobytes()


def _read_varints(buffer: np.ndarray, count: int) -> tuple[np.ndarray, int]:
    """`count` LEB128 values from the start of `buffer`, and how many bytes they took."""
    if count == 0:
        return np.zeros(0, dtype=np.int64), 0
    ends = np.flatnonzero(buffer < 0x80)
    if ends.size < count:
        raise ValueError(f"sparse payload holds {ends.size} positions, expected {count}")
    used = int(ends[count - 1]) + 1
    data = buffer[:used].astype(np.int64)
    group = np.concatenate([[0], np.cumsum(data[:-1] < 0x80)])
    first = np.concatenate([[0], ends[: count - 1] + 1])
    shift = 7 * (np.arange(used) - first[group])
    if shift.max() > 56:
        raise ValueError("sparse payload has a position gap over 2^63")
    return _sum_groups((data & 0x7F) << shift, group, count), used


def _sum_groups(values: np.ndarray, group: np.ndarray, count: int) -> np.ndarray:
    """Exact integer sums of `values` per group (np.bincount would go through float64)."""
    sums = np.zeros(count, dtype=np.int64)
    np.add.at(sums, group, values)
    return sums


def encode_sparse(values: torch.Tensor, bits: int) -> bytes:
    """Bytes for the nonzeros of flat fp32 `values` (positions exact, magnitudes in bits - 1 bits)."""
    if bits not in VALUE_BITS:
        raise ValueError(f"sparse values take 2 or 4 bits, not {bits}")
    flat = values.reshape(-1)
    positions = torch.nonzero(flat != 0).view(-1)  # NaN != 0: poison is kept
    nonzeros = flat[positions]
    gaps = np.diff(positions.numpy(), prepend=-1) - 1
    count = nonzeros.numel()
    blocks = -(-count // VALUE_BLOCK)
    padded = torch.zeros(blocks * VALUE_BLOCK)
    padded[:count] = nonzeros.abs()
    rows = padded.view(blocks, VALUE_BLOCK)
    real = torch.arange(blocks * VALUE_BLOCK).view(blocks, VALUE_BLOCK) < count
    low = torch.where(real, rows, torch.full_like(rows, float("inf"))).amin(dim=1) if blocks else torch.zeros(0)
    high = rows.amax(dim=1) if blocks else torch.zeros(0)
    bad = ~torch.isfinite(rows).all(dim=1) if blocks else torch.zeros(0, dtype=torch.bool)
    low, high = torch.where(bad, float("nan"), low), torch.where(bad, float("nan"), high)
    levels = (1 << (bits - 1)) - 1
    span = torch.where(high > low, high - low, torch.ones_like(high))
    steps = ((rows - low[:, None]) / span[:, None] * levels).round().clamp(0, levels).nan_to_num(0).to(torch.uint8)
    codes = (steps.view(-1)[:count] | ((nonzeros < 0).to(torch.uint8) << (bits - 1))).to(torch.uint8)
    per_byte = 8 // bits
    codes = torch.nn.functional.pad(codes, (0, -count % per_byte)).view(-1, per_byte)
    packed = torch.zeros(codes.shape[0], dtype=torch.uint8)
    for slot in range(per_byte):
        packed |= codes[:, slot] << (8 - bits * (slot + 1))
    scales = torch.stack([low, high], dim=1).reshape(-1)
    return _HEAD.pack(bits, count) + _varints(gaps) + scales.numpy().tobytes() + packed.numpy().tobytes()


def decode_sparse(payload: bytes, numel: int) -> torch.Tensor:
    """Flat fp32 values of `encode_sparse`'s bytes; ValueError for a payload that does not fit `numel`."""
    if len(payload) < _HEAD.size:
        raise ValueError(f"sparse payload of {len(payload)} bytes has no header")
    bits, count = _HEAD.unpack_from(payload)
    if bits not in VALUE_BITS or count > numel:
        raise ValueError(f"sparse payload of {count} nonzeros in {bits} bits for {numel} values")
    buffer = np.frombuffer(payload, dtype=np.uint8, offset=_HEAD.size)
    gaps, used = _read_varints(buffer, count)
    positions = np.cumsum(gaps + 1) - 1
    if count and positions[-1] >= numel:
        raise ValueError(f"sparse payload has position {positions[-1]} in a vector of {numel}")
    blocks, per_byte = -(-count // VALUE_BLOCK), 8 // bits
    scale_bytes, code_bytes = 8 * blocks, -(-count // per_byte)
    if len(buffer) != used + scale_bytes + code_bytes:
        raise ValueError(f"sparse payload of {len(payload)} bytes for {count} nonzeros")
    if count == 0:
        return torch.zeros(numel)
    scales = torch.frombuffer(bytearray(buffer[used : used + scale_bytes].tobytes()), dtype=torch.float32)
    low, high = scales.view(-1, 2).unbind(1)
    packed = torch.from_numpy(buffer[used + scale_bytes :].copy())
    mask = (1 << bits) - 1
    codes = torch.stack([(packed >> (8 - bits * (s + 1))) & mask for s in range(per_byte)], 1).view(-1)[:count]
    levels = (1 << (bits - 1)) - 1
    steps = (codes & levels).to(torch.float32)
    block = torch.arange(count) // VALUE_BLOCK
    magnitude = low[block] + steps / levels * (high[block] - low[block])
    signed = torch.where((codes >> (bits - 1)).bool(), -magnitude, magnitude)
    out = torch.zeros(numel)
    out[torch.from_numpy(positions)] = signed
    return out
