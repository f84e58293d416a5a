"""What each pseudo-gradient codec keeps of an fp32 vector: encode to bytes, decode back to fp32.

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
(bitsandbytes alone turns an all-NaN block into zeros). The float codecs are torch casts; the blockwise ones run
on fused kernels (`p2p_diloco.diloco.kernels`, numba), since a pass of torch ops per step cost 7-30 ms per
million values. How these bytes travel inside hivemind's all-reduce is
`p2p_diloco.net.codecs`; error feedback on top of them is `p2p_diloco.diloco.error_feedback`.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
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
    copied = bytearray(memoryview(payload)[offset : offset + nbytes])  # slicing bytes would copy once more
    return torch.frombuffer(copied, dtype=dtype), offset + nbytes


@functools.cache
def _kernels():
    """p2p_diloco.diloco.kernels, imported on first use (numba's import is 0.2 s; fp32 islands never need it)."""
    from p2p_diloco.diloco import kernels

    return kernels


class _BlockCodec:
    """The blockwise layout of int8, int4 and int2: fp32 scales[blocks], then `bits`-bit codes packed high first."""

    def __init__(self, name: str, bits: int, rms: bool) -> None:
        self.name, self.bits, self.rms = name, bits, rms
        self._lookup: tuple | None = None

    def encode(self, values: torch.Tensor, levels: torch.Tensor, block_size: int) -> bytes:
        """Scale, round to the nearest of `levels` and pack, in one pass per block."""
        if self._lookup is None:
            self._lookup = _kernels().level_lookup(levels.numpy())
        numel = values.numel()
        blocks = -(-numel // block_size)
        payload = np.empty(4 * blocks + -(-numel * self.bits // 8), dtype=np.uint8)
        scales, packed = payload[: 4 * blocks].view(np.float32), payload[4 * blocks :]
        _kernels().encode_blocks(values.numpy(), block_size, self.rms, *self._lookup, self.bits, scales, packed)
        return payload.tobytes()

    def decode(
        self, payload: bytes, numel: int, block_size: int, levels: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Values from `encode`'s bytes (written into `out`, flat contiguous fp32, if given); CodecMismatchError for
        a size or block size they cannot hold."""
        blocks = -(-numel // block_size) if block_size > 0 else 0
        expected = 4 * blocks + -(-numel * self.bits // 8)
        if block_size <= 0 or block_size % (8 // self.bits) or len(payload) != expected:
            raise CodecMismatchError(
                f"{self.name} payload of {len(payload)} bytes for {numel} values in blocks of {block_size}"
            )
        raw = np.frombuffer(payload, dtype=np.uint8)
        scales = raw[: 4 * blocks].copy().view(np.float32)  # copied: the kernel wants aligned fp32
        if out is None:
            out = torch.empty(numel, dtype=torch.float32)
        elif out.dtype != torch.float32 or out.numel() != numel or not out.is_contiguous():
            raise ValueError(f"cannot decode {numel} values into a {out.dtype} tensor of {out.numel()}")
        _kernels().decode_blocks(raw[4 * blocks :], scales, block_size, levels.numpy(), self.bits, out.view(-1).numpy())
        return out


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
        cached = self.__dict__.get("_checksum")
        if cached is None:  # asked for every part sent and received
            code = self.code_table()
            cached = self._checksum = (
                0 if code is None else zlib.crc32(code.to(torch.float32).numpy().tobytes()) & 0xFFFF
            )
        return cached

    def warm_up(self) -> None:
        """Load and compile what the format runs on now (before an averager process forks from us)."""
        self.round_trip(torch.ones(3))

    def encode(self, values: torch.Tensor) -> bytes:
        """Bytes for flat fp32 `values`."""
        raise NotImplementedError

    def decode(self, payload: bytes, numel: int, block_size: int) -> torch.Tensor:
        """Flat fp32 values from `encode`'s bytes (`block_size` as the sender used it)."""
        raise NotImplementedError

    def decode_into(self, payload: bytes, numel: int, block_size: int, out: torch.Tensor) -> torch.Tensor:
        """`decode` written into `out` (flat contiguous fp32 of `numel` values); `out`."""
        return out.copy_(self.decode(payload, numel, block_size))

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


def dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic code table (`create_dynamic_map(signed=True)`), computed as it computes it.

    Importing bitsandbytes for these 256 numbers cost every int8 island 1.6 s of its start (it pulls in torch._dynamo,
    and asks the Hugging Face Hub for a kernel unless hidden); the codec's kernels are our own already.
    tests/test_kernels.py checks this table against bitsandbytes' bit for bit, and the table's checksum travels in
    every frame, so an island with another table is told apart.
    """
    data: list[float] = []
    non_sign_bits, max_exponent_bits = 7, 7  # 8 bits, signed
    for i in range(max_exponent_bits):
        boundaries = torch.linspace(0.1, 1, 2 ** (i + non_sign_bits - max_exponent_bits) + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (256 - len(data))
    return torch.tensor(sorted(data), dtype=torch.float32)


class Blockwise(Quantizer):
    """A format of `_BlockCodec`'s layout over the levels of `code_table()`, decoded without copies."""

    _blocks: _BlockCodec

    def encode(self, values: torch.Tensor) -> bytes:
        return self._blocks.encode(values, self.code_table(), self.block_size)

    def decode(self, payload: bytes, numel: int, block_size: int) -> torch.Tensor:
        return self._blocks.decode(payload, numel, block_size, self.code_table())

    def decode_into(self, payload: bytes, numel: int, block_size: int, out: torch.Tensor) -> torch.Tensor:
        return self._blocks.decode(payload, numel, block_size, self.code_table(), out)


class Int8Blockwise(Blockwise):
    """bitsandbytes' blockwise 8-bit dynamic code: one fp32 absmax per block of 256, 8-bit codes.

    The code table is bitsandbytes' (`create_dynamic_map`, computed by `dynamic_map`); encoding rounds to the truly
    nearest level and decoding is bit for bit bitsandbytes' `dequantize_blockwise`, both in
    `p2p_diloco.diloco.kernels` (6x and 4x faster on CPU than bitsandbytes, whose encoder's binary search misses the
    nearest level for 0.15% of values).
    Payload: absmax fp32[blocks] + codes uint8[n].
    """

    name, block_size = "int8", 256
    bits_per_value = 8.0 + 32.0 / 256
    _code: torch.Tensor | None = None
    _blocks = _BlockCodec("int8", bits=8, rms=False)

    def code_table(self) -> torch.Tensor:
        if self._code is None:
            self._code = dynamic_map()
        return self._code


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


class Int4NormalFloat(Blockwise):
    """Blockwise 4-bit NormalFloat (NF4): one fp32 absmax per block of 128, two codes per byte.

    Values are scaled by their block's absmax and rounded to the nearest of 16 NF4 levels (exact zero included).
    On N(0,1) data NF4 halves the error of an E3M0 float (powers of two, as in Streaming DiLoCo): relative L2
    error 0.096 vs 0.19 at the same size. bitsandbytes' own CPU quantize_4bit is a torch bucketize (30x slower
    than the kernel here) and its CPU dequantize falls back to a torch.compile'd function for odd sizes.
    Payload: absmax fp32[blocks] + packed uint8[ceil(n / 2)] (high nibble first).
    """

    name, block_size = "int4", 128
    bits_per_value = 4.0 + 32.0 / 128
    _blocks = _BlockCodec("int4", bits=4, rms=False)

    def code_table(self) -> torch.Tensor:
        return NF4_LEVELS


INT2_LEVELS = torch.tensor([-1.5104176, -0.4527800, 0.4527800, 1.5104176])
"""The 4-level Lloyd-Max quantizer of N(0, 1): the least mean-square error 2-bit code of a Gaussian."""


class Int2Gaussian(Blockwise):
    """Blockwise 2-bit: each block of 128 values is scaled by its RMS and rounded to the nearest of
    the 4 Lloyd-Max levels of a unit Gaussian, four codes per byte.

    RMS rather than absmax scaling: with 4 levels an absmax scale would spend them on the tails. A zero block
    decodes to zeros, a block holding NaN or inf to NaN. Payload: RMS fp32[blocks] + packed uint8[ceil(n / 4)]
    (first value in the high bits). Plain 2-bit loses quality (the Decoupled DiLoCo paper: +32% loss); it is here
    to measure that, and beside error feedback.
    """

    name, block_size = "int2", 128
    bits_per_value = 2.0 + 32.0 / 128
    _blocks = _BlockCodec("int2", bits=2, rms=True)

    def code_table(self) -> torch.Tensor:
        return INT2_LEVELS


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
