"""Sparse pseudo-gradients (SparseLoCo-style): keep the top-k of each chunk, send positions and low-bit values.

Selection happens on the island, before the all-reduce: `topk_sparsify` keeps the `density` largest magnitudes
of every chunk of CHUNK values and zeroes the rest, and error feedback carries what was left out into the next
round (it is always on with this codec). The wire format (`encode_sparse`) then carries every nonzero of a
vector: positions as Golomb-Rice codes of the gaps between them (k chosen per payload: about 7.5 bits a gap at 2%
density, 6 for a merge of four islands' 2%), values as a sign bit and (bits - 1) bits of
magnitude between the smallest and largest magnitude of each block of 128 nonzeros (two fp32 per block). It
selects nothing itself, so a reducer's weighted mean of contributions with different positions (their union)
travels back with every position it holds: contributions merge exactly, up to the value bits.

    payload: bits u8 | nonzeros u32 | k u8 | unary bytes u32 | quotients (unary bits) | remainders (k bits each)
             | (low, high) fp32[2 * blocks] | codes

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
MAX_RICE = 40
"""The largest Golomb-Rice parameter a payload may declare (gaps up to 2^40 in one word of remainder bits)."""
_HEAD = struct.Struct("<BIBI")


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


def rice_parameter(gaps: np.ndarray) -> int:
    """The Golomb-Rice parameter k that codes `gaps` in the fewest bits: n * (k + 1) + sum(gaps >> k)."""
    if gaps.size == 0:
        return 0
    widest = min(MAX_RICE, int(gaps.max()).bit_length())  # a larger k only adds remainder bits
    costs = [gaps.size * (k + 1) + int((gaps >> k).sum()) for k in range(widest + 1)]
    return int(np.argmin(costs))


def rice_encode(gaps: np.ndarray, k: int) -> tuple[bytes, bytes]:
    """Golomb-Rice code of non-negative int64 gaps as two bit streams: quotients in unary (q zeros, then a one),
    and k-bit remainders; separate streams so that decoding is vectorised (the ones of the first end its codes)."""
    quotients = gaps >> k
    unary = np.zeros(int(quotients.sum()) + gaps.size, dtype=np.uint8)
    unary[np.cumsum(quotients + 1) - 1] = 1
    shifts = np.arange(k - 1, -1, -1, dtype=np.int64)
    remainders = ((gaps[:, None] >> shifts) & 1).astype(np.uint8)
    return np.packbits(unary).tobytes(), np.packbits(remainders.reshape(-1)).tobytes()


def rice_decode(unary: np.ndarray, remainders: np.ndarray, count: int, k: int, limit: int) -> np.ndarray:
    """`count` gaps of `rice_encode`'s streams (uint8 arrays); ValueError for streams that do not hold them or a
    gap over `limit`."""
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.flatnonzero(np.unpackbits(unary))
    if ends.size != count or unary.size != -(-(int(ends[-1]) + 1) // 8):
        raise ValueError(f"sparse payload holds {ends.size} positions, expected {count}")
    quotients = np.diff(ends, prepend=-1) - 1
    if int(quotients.max()) > limit >> k:
        raise ValueError(f"sparse payload has a position gap over the vector's {limit} values")
    bits = np.unpackbits(remainders)[: count * k].reshape(count, k).astype(np.int64)
    return (quotients << k) | (bits << np.arange(k - 1, -1, -1, dtype=np.int64)).sum(axis=1)


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
    k = rice_parameter(gaps)
    unary, remainders = rice_encode(gaps, k)
    head = _HEAD.pack(bits, count, k, len(unary))
    return head + unary + remainders + scales.numpy().tobytes() + packed.numpy().tobytes()


def decode_sparse(payload: bytes, numel: int) -> torch.Tensor:
    """Flat fp32 values of `encode_sparse`'s bytes; ValueError for a payload that does not fit `numel`."""
    if len(payload) < _HEAD.size:
        raise ValueError(f"sparse payload of {len(payload)} bytes has no header")
    bits, count, k, unary_bytes = _HEAD.unpack_from(payload)
    if bits not in VALUE_BITS or count > numel or k > MAX_RICE:
        raise ValueError(f"sparse payload of {count} nonzeros in {bits} bits (rice {k}) for {numel} values")
    buffer = np.frombuffer(payload, dtype=np.uint8, offset=_HEAD.size)
    blocks, per_byte = -(-count // VALUE_BLOCK), 8 // bits
    remainder_bytes, scale_bytes, code_bytes = -(-count * k // 8), 8 * blocks, -(-count // per_byte)
    used = unary_bytes + remainder_bytes
    if len(buffer) != used + scale_bytes + code_bytes:
        raise ValueError(f"sparse payload of {len(payload)} bytes for {count} nonzeros")
    gaps = rice_decode(buffer[:unary_bytes], buffer[unary_bytes:used], count, k, numel)
    positions = np.cumsum(gaps + 1) - 1
    if count and positions[-1] >= numel:
        raise ValueError(f"sparse payload has position {positions[-1]} in a vector of {numel}")
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
