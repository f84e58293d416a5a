"""Codecs for pseudo-gradients on the wire: fp32, fp16, bf16, blockwise int8 and blockwise 4-bit, decoded to fp32.

How a codec reaches every step of hivemind's all-reduce
-------------------------------------------------------
A member compresses its own parts with the `CompressionBase` object it was given, but everything else goes
through hivemind's registry `hivemind.compression.serialization._BASE_COMPRESSION_TYPES`, keyed by the
`runtime_pb2.CompressionType` enum carried in each message: reducers decode incoming parts with
`deserialize_torch_tensor`, re-encode the averaged part with `serialize_torch_tensor(part, <sender's enum>)`,
and every member decodes the results the same way. The enum is closed (proto-compiled, six values), so each
codec takes one enum value of its own and is installed in that registry when this module is imported:

    codec  wire enum (slot)   what the slot held before
    fp32   NONE               hivemind's NoCompression, kept as is
    fp16   FLOAT16            hivemind's Float16Compression, replaced by a wire-compatible subclass that also
                              takes bfloat16 input
    int8   BLOCKWISE_8BIT     hivemind's BlockwiseQuantization, broken under numpy 2 (extract() raises, so an
                              all-reduce silently leaves the tensor unaveraged)
    int4   UNIFORM_8BIT       hivemind's Uniform8BitQuantization, broken under numpy 2 the same way
    bf16   QUANTILE_8BIT      hivemind's Quantile8BitQuantization, broken under numpy 2 the same way

Only codecs that cannot work here are displaced; MEANSTD_16BIT is untouched. The three slots whose enum name does
not describe their new content carry a self-describing frame: a 12-byte header (magic, codec id, format version,
block size, a checksum of the code table) before the payload. Bytes in one of those slots that are not our frame
for that codec (a peer on stock hivemind, another codec, another bitsandbytes code table) raise
`CodecMismatchError` when decoded, and the strict all-reduce (`p2p_diloco.net.allreduce`) turns a decoding error into
a discarded round instead of hivemind's silent partial average.

Islands must agree on the codec. A mixed group is not caught by the bytes (each enum decodes with its own codec):
members cut the vector into parts of different sizes, so with several parts the round fails at the reducers after
timeouts, and with one part it completes but members decode different bits. So: announce the codec with the
island and refuse a run of another codec at join (`check_partner_codecs` on the announcements), let matchmaking
refuse such peers (`schema_hash_with_codec`), and check the gathered metadata after a round
(`check_partner_codecs` again).

Every codec decodes to fp32 (then casts back to the dtype it was given) and reducers accumulate in fp32. NaN
survives every codec, and int8/int4 turn a whole block holding NaN or inf into NaN: the strict all-reduce marks a
poisoned reduction with NaN, and that mark must survive re-encoding (bitsandbytes alone turns an all-NaN block
into zeros). fp16 clamps inf to +-65504, as hivemind's does.
"""

from __future__ import annotations

import hashlib
import math
import struct
import threading
import zlib
from collections.abc import Mapping
from typing import Any

import torch
from hivemind.compression import CompressionBase, CompressionInfo, Float16Compression, NoCompression
from hivemind.compression import serialization as _serialization
from hivemind.proto import runtime_pb2

__all__ = [
    "CODECS",
    "CodecMismatchError",
    "ErrorFeedback",
    "bits_per_value",
    "check_codec",
    "check_partner_codecs",
    "get_compression",
    "install",
    "round_trip",
    "schema_hash_with_codec",
]


class CodecMismatchError(ValueError):
    """Islands (or bytes on the wire) disagree on the pseudo-gradient codec."""


# ----- frame shared by the codecs that live in a foreign enum slot -------------------------------------------
_MAGIC = b"p2dc"
_FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sBBHI")  # magic, codec id, format version, code-table checksum, block size


def _code_checksum(code: torch.Tensor | None) -> int:
    if code is None:
        return 0
    return zlib.crc32(code.to(torch.float32).numpy().tobytes()) & 0xFFFF


def _padded_blocks(values: torch.Tensor, block_size: int) -> torch.Tensor:
    """`values` (flat fp32) zero-padded to whole blocks, as (blocks, block_size)."""
    blocks = max(1, -(-values.numel() // block_size))
    if values.numel() == blocks * block_size:
        return values.view(blocks, block_size)
    padded = values.new_zeros(blocks * block_size)
    padded[: values.numel()] = values
    return padded.view(blocks, block_size)


def _poison_non_finite_blocks(values: torch.Tensor, absmax: torch.Tensor, block_size: int) -> torch.Tensor:
    """Set the scale of every block that holds NaN or inf to NaN, so that the whole block decodes to NaN."""
    if bool(torch.isfinite(values).all()):
        return absmax
    bad = ~torch.isfinite(_padded_blocks(values, block_size)).all(dim=1)
    return torch.where(bad, torch.full_like(absmax, float("nan")), absmax)


class _FramedCodec(CompressionBase):
    """A codec whose payload starts with our header; subclasses encode and decode flat fp32 values."""

    name: str
    codec_id: int
    block_size: int = 0
    bits_per_value: float

    def _code_table(self) -> torch.Tensor | None:
        return None

    def _encode(self, values: torch.Tensor) -> bytes:
        raise NotImplementedError

    def _decode(self, payload: bytes, numel: int, block_size: int) -> torch.Tensor:
        raise NotImplementedError

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        if not torch.is_floating_point(tensor):
            raise ValueError(f"codec {self.name} does not support {tensor.dtype} tensors")
        requires_grad = tensor.requires_grad
        tensor = tensor.detach().cpu()
        values = tensor.reshape(-1).to(torch.float32).contiguous()
        header = _HEADER.pack(
            _MAGIC, self.codec_id, _FORMAT_VERSION, _code_checksum(self._code_table()), self.block_size
        )
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=header + (self._encode(values) if values.numel() else b""),
            size=tensor.shape,
            dtype=str(tensor.dtype).replace("torch.", ""),
            requires_grad=requires_grad,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        buffer = serialized_tensor.buffer
        slot = runtime_pb2.CompressionType.Name(serialized_tensor.compression)
        if len(buffer) < _HEADER.size or buffer[: len(_MAGIC)] != _MAGIC:
            raise CodecMismatchError(
                f"a {slot} payload is not in p2p_diloco's {self.name} format (a peer with another codec setup?)"
            )
        _, codec_id, version, checksum, block_size = _HEADER.unpack_from(buffer)
        if codec_id != self.codec_id or version != _FORMAT_VERSION:
            raise CodecMismatchError(
                f"a {slot} payload holds codec id {codec_id} v{version}, expected {self.name} "
                f"(id {self.codec_id} v{_FORMAT_VERSION})"
            )
        if checksum != _code_checksum(self._code_table()):
            raise CodecMismatchError(f"{self.name} payload quantized with another code table (bitsandbytes version?)")
        numel = math.prod(serialized_tensor.size)
        payload = buffer[_HEADER.size :]
        if numel == 0 and not payload:
            values = torch.empty(0)
        elif numel == 0 or (self.block_size and not block_size):
            raise CodecMismatchError(f"{self.name} payload of {len(payload)} bytes for {numel} values")
        else:
            values = self._decode(payload, numel, block_size)
        dtype = getattr(torch, serialized_tensor.dtype)
        return values.to(dtype).reshape(tuple(serialized_tensor.size)).requires_grad_(serialized_tensor.requires_grad)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.bits_per_value / torch.finfo(info.descriptor.dtype).bits

    def __repr__(self) -> str:
        return f"p2p_diloco.net.codecs.{type(self).__name__}()"


def _read(payload: bytes, offset: int, count: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """`count` values of `dtype` at `offset` (copied, so the tensor is writable), and the offset after them."""
    nbytes = count * torch.empty(0, dtype=dtype).element_size()
    if offset + nbytes > len(payload):
        raise CodecMismatchError(f"truncated payload: needs {offset + nbytes} bytes, has {len(payload)}")
    if count == 0:
        return torch.empty(0, dtype=dtype), offset
    return torch.frombuffer(bytearray(payload[offset : offset + nbytes]), dtype=dtype), offset + nbytes


# ----- the codecs -------------------------------------------------------------------------------------------
class Float16Codec(Float16Compression):
    """IEEE half precision, wire-compatible with hivemind's Float16Compression, also for bfloat16 input.

    Like hivemind's, it clamps to +-65504; values below 6.1e-5 lose relative precision (fp16 subnormals).
    """

    name = "fp16"
    bits_per_value = 16.0

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        if tensor.dtype != torch.bfloat16:
            return super().compress(tensor, info, allow_inplace)
        message = super().compress(tensor.detach().to(torch.float32), info, allow_inplace=True)
        message.dtype, message.requires_grad = "bfloat16", tensor.requires_grad
        return message

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        if serialized_tensor.dtype == "float16":  # hivemind would return a view of the read-only message buffer
            half, _ = _read(serialized_tensor.buffer, 0, math.prod(serialized_tensor.size), torch.float16)
            return half.reshape(tuple(serialized_tensor.size)).requires_grad_(serialized_tensor.requires_grad)
        if serialized_tensor.dtype != "bfloat16":
            return super().extract(serialized_tensor)
        half, _ = _read(serialized_tensor.buffer, 0, math.prod(serialized_tensor.size), torch.float16)
        return (
            half.to(torch.bfloat16)
            .reshape(tuple(serialized_tensor.size))
            .requires_grad_(serialized_tensor.requires_grad)
        )

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.bits_per_value / torch.finfo(info.descriptor.dtype).bits

    def __repr__(self) -> str:
        return "p2p_diloco.net.codecs.Float16Codec()"


class BFloat16Codec(_FramedCodec):
    """bfloat16 (8-bit mantissa, fp32's exponent range): round to nearest even, NaN and inf kept."""

    name, codec_id, bits_per_value = "bf16", 1, 16.0
    compression_type = runtime_pb2.CompressionType.QUANTILE_8BIT

    def _encode(self, values: torch.Tensor) -> bytes:
        return values.to(torch.bfloat16).view(torch.int16).numpy().tobytes()

    def _decode(self, payload: bytes, numel: int, block_size: int) -> torch.Tensor:
        raw, end = _read(payload, 0, numel, torch.int16)
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
            import bitsandbytes.functional as functional

            _BNB_FUNCTIONAL = functional
    return _BNB_FUNCTIONAL


class Int8BlockwiseCodec(_FramedCodec):
    """bitsandbytes' blockwise 8-bit dynamic quantization: one fp32 absmax per block of 256, 8-bit codes.

    Payload: absmax fp32[blocks] + codes uint8[n]. Bits per value: 8 + 32/256 = 8.125.
    """

    name, codec_id, block_size = "int8", 2, 256
    bits_per_value = 8.0 + 32.0 / 256
    compression_type = runtime_pb2.CompressionType.BLOCKWISE_8BIT
    _code: torch.Tensor | None = None

    def _code_table(self) -> torch.Tensor:
        if self._code is None:
            self._code = _bitsandbytes().create_dynamic_map(signed=True).to(torch.float32)
        return self._code

    def warm_up(self) -> None:
        """Import bitsandbytes and load its CPU kernels now (before an averager process forks from us)."""
        self.extract(self.compress(torch.ones(3), CompressionInfo.from_tensor(torch.ones(3))))

    def _encode(self, values: torch.Tensor) -> bytes:
        functional = _bitsandbytes()
        codes, state = functional.quantize_blockwise(values, code=self._code_table(), blocksize=self.block_size)
        absmax = _poison_non_finite_blocks(values, state.absmax.to(torch.float32), self.block_size)
        return absmax.numpy().tobytes() + codes.numpy().tobytes()

    def _decode(self, payload: bytes, numel: int, block_size: int) -> torch.Tensor:
        blocks = -(-numel // block_size)
        absmax, offset = _read(payload, 0, blocks, torch.float32)
        codes, end = _read(payload, offset, numel, torch.uint8)
        if end != len(payload):
            raise CodecMismatchError(f"int8 payload of {len(payload)} bytes for {numel} values")
        return (
            _bitsandbytes()
            .dequantize_blockwise(codes, absmax=absmax, code=self._code_table(), blocksize=block_size)
            .to(torch.float32)
        )


# NormalFloat4 levels (QLoRA; the table bitsandbytes uses for quant_type="nf4"), ascending.
_NF4 = torch.tensor(
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


class Int4BlockwiseCodec(_FramedCodec):
    """Blockwise 4-bit NormalFloat (NF4) in pure torch: one fp32 absmax per block of 128, two codes per byte.

    Values are scaled by their block's absmax and rounded to the nearest of 16 NF4 levels (exact zero included).
    On N(0,1) data NF4 halves the error of an E3M0 float (powers of two, as in Streaming DiLoCo): relative L2
    error 0.096 vs 0.19 at the same size. bitsandbytes' own CPU quantize_4bit is the same bucketize in torch,
    but its CPU dequantize falls back to a torch.compile'd function for odd sizes, which we avoid.
    Payload: absmax fp32[blocks] + packed uint8[ceil(n / 2)] (high nibble first). Bits per value: 4.25.
    """

    name, codec_id, block_size = "int4", 3, 128
    bits_per_value = 4.0 + 32.0 / 128
    compression_type = runtime_pb2.CompressionType.UNIFORM_8BIT
    _levels = _NF4
    _midpoints = (_NF4[1:] + _NF4[:-1]) / 2
    # value pairs of every byte: a decoded byte is one row lookup instead of two
    _pairs = torch.stack(
        [_NF4.repeat_interleave(16), _NF4.repeat(16)],
        dim=1,
    )

    def _code_table(self) -> torch.Tensor:
        return self._levels

    def _encode(self, values: torch.Tensor) -> bytes:
        numel = values.numel()
        blocks = _padded_blocks(values, self.block_size)
        absmax = blocks.abs().amax(dim=1)
        scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        indices = torch.bucketize(blocks / scale[:, None], self._midpoints, out_int32=True).view(-1)
        indices = indices[: numel + (numel & 1)].to(torch.uint8)  # padding holds zeros; keep one to pair with
        packed = (indices[0::2] << 4) | indices[1::2]
        absmax = torch.where(torch.isfinite(absmax), absmax, float("nan"))  # amax already propagates NaN
        return absmax.numpy().tobytes() + packed.numpy().tobytes()

    def _decode(self, payload: bytes, numel: int, block_size: int) -> torch.Tensor:
        blocks = -(-numel // block_size)
        absmax, offset = _read(payload, 0, blocks, torch.float32)
        packed, end = _read(payload, offset, (numel + 1) // 2, torch.uint8)
        if end != len(payload):
            raise CodecMismatchError(f"int4 payload of {len(payload)} bytes for {numel} values")
        levels = self._pairs.index_select(0, packed.to(torch.int32)).view(-1)
        if levels.numel() != blocks * block_size:
            padded = levels.new_zeros(blocks * block_size)
            padded[:numel] = levels[:numel]
            levels = padded
        return levels.view(blocks, block_size).mul_(absmax[:, None]).view(-1)[:numel]


class Float32Codec(NoCompression):
    """No compression: the fp32 buffer travels as is (hivemind's NoCompression, under a name)."""

    name = "fp32"
    bits_per_value = 32.0

    def __repr__(self) -> str:
        return "p2p_diloco.net.codecs.Float32Codec()"


CODECS: dict[str, CompressionBase] = {
    "fp32": Float32Codec(),
    "fp16": Float16Codec(),
    "bf16": BFloat16Codec(),
    "int8": Int8BlockwiseCodec(),
    "int4": Int4BlockwiseCodec(),
}
"""Codec instances by name. Every island of a run must use the same one."""

_STOCK_OCCUPANTS = {
    "FLOAT16": "Float16Compression",
    "BLOCKWISE_8BIT": "BlockwiseQuantization",
    "UNIFORM_8BIT": "Uniform8BitQuantization",
    "QUANTILE_8BIT": "Quantile8BitQuantization",
}


def install() -> None:
    """Put our codecs into hivemind's compression registry (idempotent; done when this module is imported).

    Refuses to overwrite a slot that someone else has already replaced.
    """
    registry = _serialization._BASE_COMPRESSION_TYPES
    for codec in CODECS.values():
        slot = runtime_pb2.CompressionType.Name(codec.compression_type)
        if slot == "NONE":
            continue  # hivemind's NoCompression already is our fp32 codec
        current = registry[slot]
        if current is codec:
            continue
        if type(current).__name__ != _STOCK_OCCUPANTS[slot] or type(current).__module__.split(".")[0] != "hivemind":
            raise RuntimeError(f"hivemind compression slot {slot} already holds {current!r}; cannot install {codec!r}")
        registry[slot] = codec


install()


def get_compression(name: str) -> CompressionBase:
    """The codec `name` as a hivemind CompressionBase (for GossipExchange(compression=...)).

    Call it before the averager process starts: int8 imports bitsandbytes here (seconds) so that the forked
    averager inherits the loaded library instead of importing it in the middle of its first all-reduce.
    """
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODECS)}")
    install()
    codec = CODECS[name]
    if isinstance(codec, Int8BlockwiseCodec):
        codec.warm_up()
    return codec


def bits_per_value(name: str) -> float:
    """Bits on the wire per fp32 value, block scales included (frame headers of 12 bytes per part excluded)."""
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODECS)}")
    return float(CODECS[name].bits_per_value)


def round_trip(compression: CompressionBase | str, tensor: torch.Tensor) -> torch.Tensor:
    """What peers decode when `tensor` is sent as one part with `compression`, in fp32."""
    codec = get_compression(compression) if isinstance(compression, str) else compression
    message = codec.compress(tensor.detach(), CompressionInfo.from_tensor(tensor))
    return codec.extract(message).to(torch.float32)


# ----- agreeing on the codec ----------------------------------------------------------------------------------
def check_codec(ours: str, theirs: Any, peer: str = "a peer") -> None:
    """Raise CodecMismatchError (one line) unless the codec `peer` announced is ours."""
    if theirs != ours:
        announced = "no codec" if theirs is None else f"codec {theirs!r}"
        raise CodecMismatchError(
            f"codec mismatch: {peer} announced {announced} but this island uses {ours!r}; "
            "every island of a run must use the same codec"
        )


def check_partner_codecs(ours: str, partners: Mapping[str, Mapping[str, Any]], key: str = "codec") -> None:
    """Check the codec every partner announced in its gathered metadata (peer id -> metadata dict)."""
    strangers = {peer: data.get(key) for peer, data in partners.items() if data.get(key) != ours}
    if not strangers:
        return
    if len(strangers) == 1:
        check_codec(ours, *strangers.values(), peer=f"island {next(iter(strangers))}")
    announced = ", ".join(f"{peer}={codec!r}" for peer, codec in strangers.items())
    raise CodecMismatchError(
        f"codec mismatch: islands announced {announced} but this island uses {ours!r}; "
        "every island of a run must use the same codec"
    )


def schema_hash_with_codec(schema_hash: bytes, name: str) -> bytes:
    """An averager's schema hash that also names the codec, so that matchmaking refuses islands of another codec.

    hivemind's leaders reject a follower whose schema hash differs (BAD_SCHEMA_HASH) before any all-reduce starts;
    without this, members of different codecs cut the vector into parts of different sizes and the round fails at
    the reducers only after timeouts (or, with one part each, succeeds with members holding different bits).
    """
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODECS)}")
    return hashlib.sha1(schema_hash + b"|codec=" + name.encode()).digest()


# ----- error feedback -------------------------------------------------------------------------------------------
class ErrorFeedback:
    """Carries the quantization residual of one round into the next, in fp32.

    Each round: `compensated = ef.compensate(delta)`; send `compensated`; `ef.update(round_trip(codec,
    compensated), compensated)`. The sum of what was sent then equals the sum of the deltas minus the current
    residual, so quantization errors no longer accumulate. When a round is discarded and the island applies its
    own full-precision `compensated` instead, call `clear()`: nothing was lost.
    """

    def __init__(self) -> None:
        self.residual: torch.Tensor | None = None

    def compensate(self, delta: torch.Tensor) -> torch.Tensor:
        """`delta + residual` in fp32 (a new tensor)."""
        delta = delta.detach().to(torch.float32)
        if self.residual is None:
            return delta.clone()
        if self.residual.shape != delta.shape:
            raise ValueError(f"error feedback residual has shape {tuple(self.residual.shape)}, delta {delta.shape}")
        return delta + self.residual

    def update(self, sent_decoded: torch.Tensor, compensated: torch.Tensor) -> None:
        """Remember what the codec dropped this round: `compensated - sent_decoded`."""
        if sent_decoded.shape != compensated.shape:
            raise ValueError(f"shapes differ: sent {tuple(sent_decoded.shape)}, compensated {compensated.shape}")
        self.residual = compensated.detach().to(torch.float32) - sent_decoded.detach().to(torch.float32)
        if not bool(torch.isfinite(self.residual).all()):
            self.residual = None  # never carry NaN or inf into later rounds

    def clear(self) -> None:
        """Forget the residual (after applying the full-precision update locally, or after a resync)."""
        self.residual = None
