"""What each pseudo-gradient codec keeps of an fp32 vector, in pure torch: encode to bytes, decode back to fp32.

    codec  format                                             bits per value
    fp32   the values as they are                             32
    fp16   IEEE half, clamped to +-65504                      16
    bf16   bfloat16, round to nearest even                    16
    int8   bitsandbytes' blockwise dynamic 8-bit, blocks 256  8 + 32/256 (one fp32 absmax per block)
    int4   NormalFloat4 (QLoRA's levels), blocks of 128       4 + 32/128
    int2   2-bit Lloyd-Max levels of a Gaussian, blocks 128   2 + 32/128 (one fp32 RMS per block)
    topk   the nonzeros of a top-k sparsified vector          about 9.6 per nonzero (2-bit values, Rice-coded
           (`p2p_diloco.diloco.sparse`)                       gaps): 0.19 per value at 2% density

Every codec decodes to fp32. NaN survives every codec, and int8/int4 turn a whole block holding NaN or inf into
NaN, so a poisoned reduction (the strict all-reduce marks one with NaN) stays poisoned after re-encoding
(bitsandbytes alone turns an all-NaN block into zeros). How these bytes travel inside hivemind's all-reduce is
`p2p_diloco.net.codecs`; error feedback on top of them is `p2p_diloco.diloco.error_feedback`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import threading
import zlib
from collections.abc import Iterator

import torch

from p2p_diloco.diloco.sparse import decode_sparse, encode_sparse


class CodecMismatchError(ValueError):
    """Islands (or bytes on the wire) disagree on the pseudo-gradient codec, or a payload is malformed."""


def read_values(payload: bytes, offset: int, count: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """`count` values of `dtype` at `offset` (copied, so the tensor is writable), and the offset after them."""
    nbytes = count * torch.empty(0, dtype=dtype).element_size()
    if offset + nbytes > len(payload):
        raise CodecMismatchError(f"truncated payload: needs {offset + nbytes} bytes, has {len(payload)}")
    if count == 0:
        return torch.empty(0, dtype=dtype), offset
    return torch.frombuffer(bytearray(payload[offset : offset + nbytes]), dtype=dtype), offset + nbytes


def padded_blocks(values: torch.Tensor, block_size: int) -> torch.Tensor:
    """`values` (flat fp32) zero-padded to whole blocks, as (blocks, block_size)."""
    blocks = max(1, -(-values.numel() // block_size))
    if values.numel() == blocks * block_size:
        return values.view(blocks, block_size)
    padded = values.new_zeros(blocks * block_size)
    padded[: values.numel()] = values
    return padded.view(blocks, block_size)


def _poison_non_finite_blocks(values: torch.Tensor, absmax: torch.Tensor, block_size: int) -> torch.Tensor:
    """Set the scale of every block that holds NaN or inf to NaN, so that the whole block decodes to NaN."""
    if math.isfinite(float(values.sum())):  # a NaN or inf anywhere makes the sum NaN or inf; 4x cheaper than isfinite
        return absmax
    bad = ~torch.isfinite(padded_blocks(values, block_size)).all(dim=1)
    return torch.where(bad, torch.full_like(absmax, float("nan")), absmax)


def level_indices(values: torch.Tensor, midpoints: torch.Tensor) -> torch.Tensor:
    """Index of the nearest level for each value, as uint8, given the ascending midpoints between the levels: what
    torch.bucketize(values, midpoints) gives, 2-3x faster for the few levels of a 2- or 4-bit code."""
    indices = torch.zeros(values.shape, dtype=torch.uint8)
    for midpoint in midpoints.tolist():
        indices += values > midpoint
    return indices


class Quantizer:
    """One codec's format: `decode(encode(values))` is what peers receive for flat fp32 `values`."""

    name: str
    bits_per_value: float
    block_size: int = 0

    def code_table(self) -> torch.Tensor | None:
        """The levels values are rounded to, if the format has a table (its checksum travels in frames)."""
        return None

    def table_checksum(self) -> int:
        """16-bit checksum of the code table: peers with another table (another bitsandbytes) are told apart."""
        code = self.code_table()
        return 0 if code is None else zlib.crc32(code.to(torch.float32).numpy().tobytes()) & 0xFFFF

    def encode(self, values: torch.Tensor) -> bytes:
        """Bytes for flat fp32 `values`."""
        raise NotImplementedError

    def decode(self, payload: bytes, numel: int, block_size: int) -> torch.Tensor:
        """Flat fp32 values from `encode`'s bytes (`block_size` as the sender used it)."""
        raise NotImplementedError

    def round_trip(self, values: torch.Tensor) -> torch.Tensor:
        """What a peer decodes from `values`, in fp32 and in `values`' shape."""
        flat = values.detach().reshape(-1).to(torch.float32).contiguous()
        if flat.numel() == 0:
            return flat.reshape(values.shape)
        return self.decode(self.encode(flat), flat.numel(), self.block_size).reshape(values.shape)


class Float32(Quantizer):
    """No compression."""

    name, bits_per_value = "fp32", 32.0

    def encode(self, values: torch.Tensor) -> bytes:
        return values.numpy().tobytes()

    def decode(self, payload: bytes, numel: int, block_size: int) -> torch.Tensor:
        values, end = read_values(payload, 0, numel, torch.float32)
        if end != len(payload):
            raise CodecMismatchError(f"fp32 payload of {len(payload)} bytes for {numel} values")
        return values


class Float16(Quantizer):
    """IEEE half precision; clamps to +-65504, values below 6.1e-5 lose relative precision (subnormals)."""

    name, bits_per_value = "fp16", 16.0
    limit = torch.finfo(torch.float16).max

    def encode(self, values: torch.Tensor) -> bytes:
        return values.clamp(-self.limit, self.limit).to(torch.float16).numpy().tobytes()

    def decode(self, payload: bytes, numel: int, block_size: int) -> torch.Tensor:
        half, end = read_values(payload, 0, numel, torch.float16)
        if end != len(payload):
            raise CodecMismatchError(f"fp16 payload of {len(payload)} bytes for {numel} values")
        return half.to(torch.float32)


class BFloat16(Quantizer):
    """bfloat16 (8-bit mantissa, fp32's exponent range): round to nearest even, NaN and inf kept."""

    name, bits_per_value = "bf16", 16.0

    def encode(self, values: torch.Tensor) -> bytes:
        return values.to(torch.bfloat16).view(torch.int16).numpy().tobytes()

    def decode(self, payload: bytes, numel: int, block_size: int) -> torch.Tensor:
        raw, end = read_values(payload, 0, numel, torch.int16)
        if end != len(payload):
            raise CodecMismatchError(f"bf16 payload of {len(payload)} bytes for {numel} values")
        return raw.view(torch.bfloat16).to(torch.float32)


_BNB_LOCK = threading.Lock()
_BNB_FUNCTIONAL = None


def _bitsandbytes():
    """bitsandbytes.functional, imported on first use (the import takes seconds: it pulls in torch._dynamo)."""
    global _BNB_FUNCTIONAL
    with _BNB_LOCK:
        if _BNB_FUNCTIONAL is None:
            with _without_hub_kernels():
                import bitsandbytes.functional as functional

            _BNB_FUNCTIONAL = functional
    return _BNB_FUNCTIONAL


@contextlib.contextmanager
def _without_hub_kernels() -> Iterator[None]:
    """Hide the `kernels` package while bitsandbytes imports, and its warning that the kernel is missing.

    Its CPU backend asks the Hugging Face Hub for an optional 4-bit matmul kernel at import (`kernels.get_kernel`):
    a network request that a peer must never make at run time, and about 0.4 s of every island's start, for a kernel
    these codecs never call. With the package hidden, bitsandbytes takes its own fallback.
    """
    hidden = "kernels" not in sys.modules
    if hidden:
        sys.modules["kernels"] = None  # type: ignore[assignment]  # `from kernels import ...` raises ImportError
    cpu_ops_log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = cpu_ops_log.level
    cpu_ops_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        cpu_ops_log.setLevel(level)
        if hidden:
            sys.modules.pop("kernels", None)


class Int8Blockwise(Quantizer):
    """bitsandbytes' blockwise 8-bit dynamic quantization: one fp32 absmax per block of 256, 8-bit codes.

    Payload: absmax fp32[blocks] + codes uint8[n].
    """

    name, block_size = "int8", 256
    bits_per_value = 8.0 + 32.0 / 256
    _code: torch.Tensor | None = None

    def code_table(self) -> torch.Tensor:
        if self._code is None:
            self._code = _bitsandbytes().create_dynamic_map(signed=True).to(torch.float32)
        return self._code

    def warm_up(self) -> None:
        """Import bitsandbytes and load its CPU kernels now (before an averager process forks from us)."""
        self.round_trip(torch.ones(3))

    def encode(self, values: torch.Tensor) -> bytes:
        codes, state = _bitsandbytes().quantize_blockwise(values, code=self.code_table(), blocksize=self.block_size)
        absmax = _poison_non_finite_blocks(values, state.absmax.to(torch.float32), self.block_size)
        return absmax.numpy().tobytes() + codes.numpy().tobytes()

    def decode(self, payload: bytes, numel: int, block_size: int) -> torch.Tensor:
        blocks = -(-numel // block_size)
        absmax, offset = read_values(payload, 0, blocks, torch.float32)
        codes, end = read_values(payload, offset, numel, torch.uint8)
        if end != len(payload):
            raise CodecMismatchError(f"int8 payload of {len(payload)} bytes for {numel} values")
        return (
            _bitsandbytes()
            .dequantize_blockwise(codes, absmax=absmax, code=self.code_table(), blocksize=block_size)
            .to(torch.float32)
        )


# NormalFloat4 levels (QLoRA; the table bitsandbytes uses for quant_type="nf4"), ascending.
NF4_LEVELS = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236328,
        1.0,
    ]
)


class Int4NormalFloat(Quantizer):
    """Blockwise 4-bit NormalFloat (NF4) in pure torch: one fp32 absmax per block of 128, two codes per byte.

    Values are scaled by their block's absmax and rounded to the nearest of 16 NF4 levels (exact zero included).
    On N(0,1) data NF4 halves the error of an E3M0 float (powers of two, as in Streaming DiLoCo): relative L2
    error 0.096 vs 0.19 at the same size. bitsandbytes' own CPU quantize_4bit is the same bucketize in torch,
    but its CPU dequantize falls back to a torch.compile'd function for odd sizes, which we avoid.
    Payload: absmax fp32[blocks] + packed uint8[ceil(n / 2)] (high nibble first).
    """

    name, block_size = "int4", 128
    bits_per_value = 4.0 + 32.0 / 128
    _midpoints = (NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2
    # value pairs of every byte: a decoded byte is one row lookup instead of two
    _pairs = torch.stack([NF4_LEVELS.repeat_interleave(16), NF4_LEVELS.repeat(16)], dim=1)

    def code_table(self) -> torch.Tensor:
        return NF4_LEVELS

    def encode(self, values: torch.Tensor) -> bytes:
        numel = values.numel()
        blocks = padded_blocks(values, self.block_size)
        absmax = blocks.abs().amax(dim=1)
        scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        indices = level_indices(blocks / scale[:, None], self._midpoints).view(-1)
        indices = indices[: numel + (numel & 1)]  # padding holds zeros; keep one to pair with
        packed = (indices[0::2] << 4) | indices[1::2]
        absmax = torch.where(torch.isfinite(absmax), absmax, float("nan"))  # amax already propagates NaN
        return absmax.numpy().tobytes() + packed.numpy().tobytes()

    def decode(self, payload: bytes, numel: int, block_size: int) -> torch.Tensor:
        blocks = -(-numel // block_size)
        absmax, offset = read_values(payload, 0, blocks, torch.float32)
        packed, end = read_values(payload, offset, (numel + 1) // 2, torch.uint8)
        if end != len(payload):
            raise CodecMismatchError(f"int4 payload of {len(payload)} bytes for {numel} values")
        levels = self._pairs.index_select(0, packed.to(torch.int32)).view(-1)
        if levels.numel() != blocks * block_size:
            padded = levels.new_zeros(blocks * block_size)
            padded[:numel] = levels[:numel]
            levels = padded
        return levels.view(blocks, block_size).mul_(absmax[:, None]).view(-1)[:numel]


INT2_LEVELS = torch.tensor([-1.5104176, -0.4527800, 0.4527800, 1.5104176])
"""The 4-level Lloyd-Max quantizer of N(0, 1): the least mean-square error 2-bit code of a Gaussian."""


class Int2Gaussian(Quantizer):
    """Blockwise 2-bit in pure torch: each block of 128 values is scaled by its RMS and rounded to the nearest of
    the 4 Lloyd-Max levels of a unit Gaussian, four codes per byte.

    RMS rather than absmax scaling: with 4 levels an absmax scale would spend them on the tails. A zero block
    decodes to zeros, a block holding NaN or inf to NaN. Payload: RMS fp32[blocks] + packed uint8[ceil(n / 4)]
    (first value in the high bits). Plain 2-bit loses quality (the Decoupled DiLoCo paper: +32% loss); it is here
    to measure that, and beside error feedback.
    """

    name, block_size = "int2", 128
    bits_per_value = 2.0 + 32.0 / 128
    _midpoints = (INT2_LEVELS[1:] + INT2_LEVELS[:-1]) / 2
    _quads = INT2_LEVELS[torch.stack([(torch.arange(256) >> shift) & 3 for shift in (6, 4, 2, 0)], dim=1)]

    def code_table(self) -> torch.Tensor:
        return INT2_LEVELS

    def encode(self, values: torch.Tensor) -> bytes:
        numel = values.numel()
        blocks = padded_blocks(values, self.block_size)
        counts = torch.full((blocks.shape[0],), float(self.block_size))
        counts[-1] = numel - (blocks.shape[0] - 1) * self.block_size  # the padding of the last block is not data
        rms = (blocks.square().sum(dim=1) / counts).sqrt()
        scale = torch.where(rms > 0, rms, torch.ones_like(rms))
        codes = level_indices(blocks / scale[:, None], self._midpoints).view(-1)[:numel]
        codes = torch.nn.functional.pad(codes, (0, -numel % 4)).view(-1, 4)
        packed = (codes[:, 0] << 6) | (codes[:, 1] << 4) | (codes[:, 2] << 2) | codes[:, 3]
        rms = _poison_non_finite_blocks(values, rms, self.block_size)
        return rms.numpy().tobytes() + packed.numpy().tobytes()

    def decode(self, payload: bytes, numel: int, block_size: int) -> torch.Tensor:
        blocks = -(-numel // block_size)
        rms, offset = read_values(payload, 0, blocks, torch.float32)
        packed, end = read_values(payload, offset, (numel + 3) // 4, torch.uint8)
        if end != len(payload):
            raise CodecMismatchError(f"int2 payload of {len(payload)} bytes for {numel} values")
        levels = self._quads.index_select(0, packed.to(torch.int32)).view(-1)  # a byte's four levels at once
        if levels.numel() != blocks * block_size:
            padded = levels.new_zeros(blocks * block_size)
            padded[: min(numel, levels.numel())] = levels[:numel]
            levels = padded
        return levels.view(blocks, block_size).mul_(rms[:, None]).view(-1)[:numel]


class TopKSparse(Quantizer):
    """The nonzeros of a sparsified pseudo-gradient: exact positions, values in `value_bits` (2 or 4) bits.

    It selects nothing: islands sparsify first (`sparse.topk_sparsify`, with error feedback), and a reducer's
    merge of several sparse contributions goes back with all the positions it holds.
    """

    name, block_size = "topk", 0
    bits_per_value = 0.02 * 9.6  # nominal: 2% density, 2-bit values, Rice-coded gaps
    value_bits = 2
    """Bits per nonzero value for what this process encodes (decoding reads them from the payload)."""

    def encode(self, values: torch.Tensor) -> bytes:
        return encode_sparse(values, self.value_bits)

    def decode(self, payload: bytes, numel: int, block_size: int) -> torch.Tensor:
        try:
            return decode_sparse(payload, numel)
        except ValueError as error:
            raise CodecMismatchError(str(error)) from None


QUANTIZERS: dict[str, Quantizer] = {
    q.name: q
    for q in (Float32(), Float16(), BFloat16(), Int8Blockwise(), Int4NormalFloat(), Int2Gaussian(), TopKSparse())
}
"""Every codec's format, by name. Every island of a run must use the same one."""
CODEC_NAMES: tuple[str, ...] = tuple(QUANTIZERS)


def quantizer(name: str) -> Quantizer:
    """The format of codec `name`; ValueError naming the choices for an unknown one."""
    if name not in QUANTIZERS:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(QUANTIZERS)}")
    return QUANTIZERS[name]
