"""Pseudo-gradient codecs inside hivemind's all-reduce: one registry, one agreement check.

The formats themselves are `p2p_diloco.diloco.quantize` (pure torch). This module carries them on the wire.

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
    int2   MEANSTD_16BIT      hivemind's ScaledFloat16Compression (mean/std fp16), which nothing here uses: the
    topk   MEANSTD_16BIT      last free slot, shared by two codecs (`SharedSlot`: decoded by the codec id in the
                              frame, encoded with the codec this process's island uses)

Only codecs that cannot work here, and the one unused slot, are displaced. The four slots whose enum name does
not describe their new content carry a self-describing frame: a 12-byte header (magic, codec id, format version,
a checksum of the code table, block size) before the payload. Bytes in one of those slots that are not our frame
for that codec (a peer on stock hivemind, another codec, another bitsandbytes code table) raise
`CodecMismatchError` when decoded, and the strict all-reduce (`p2p_diloco.net.allreduce`) turns a decoding error
into a discarded round instead of hivemind's silent partial average.

Islands must agree on the codec. A mixed group is not caught by the bytes (each enum decodes with its own codec):
members cut the vector into parts of different sizes, so with several parts the round fails at the reducers after
timeouts, and with one part it completes but members decode different bits. So: the codec is announced with the
island and checked by `strangers` (at join, on the announcements, and after each round, on the gathered
metadata), and matchmaking refuses islands of another codec (`schema_hash_with_codec`).
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping
from typing import Any

import torch
from hivemind.compression import CompressionBase, CompressionInfo, Float16Compression, NoCompression
from hivemind.compression import serialization as _serialization
from hivemind.proto import runtime_pb2

from p2p_diloco.diloco.quantize import (
    CODEC_NAMES,
    CodecMismatchError,
    Quantizer,
    quantizer,
    read_values,
)

__all__ = [
    "CODECS",
    "CodecMismatchError",
    "bits_per_value",
    "decode_into",
    "get_compression",
    "install",
    "round_trip",
    "schema_hash_with_codec",
    "strangers",
]

_MAGIC = b"p2dc"
_FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sBBHI")  # magic, codec id, format version, code-table checksum, block size
_CODEC_IDS = {"bf16": 1, "int8": 2, "int4": 3, "int2": 4, "topk": 5}
_SLOTS = {
    "bf16": runtime_pb2.CompressionType.QUANTILE_8BIT,
    "int8": runtime_pb2.CompressionType.BLOCKWISE_8BIT,
    "int4": runtime_pb2.CompressionType.UNIFORM_8BIT,
    "int2": runtime_pb2.CompressionType.MEANSTD_16BIT,
    "topk": runtime_pb2.CompressionType.MEANSTD_16BIT,
}


class FramedCodec(CompressionBase):
    """A quantizer in a foreign enum slot: its payload starts with our header, checked before decoding."""

    def __init__(self, format: Quantizer) -> None:
        super().__init__()
        self.format = format
        self.name, self.block_size, self.bits_per_value = format.name, format.block_size, format.bits_per_value
        self.codec_id, self.compression_type = _CODEC_IDS[format.name], _SLOTS[format.name]

    def _code_table(self) -> torch.Tensor | None:
        return self.format.code_table()

    def warm_up(self) -> None:
        """Load and compile the format's kernels now, before an averager process forks from us."""
        self.format.warm_up()

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        if not torch.is_floating_point(tensor):
            raise ValueError(f"codec {self.name} does not support {tensor.dtype} tensors")
        requires_grad = tensor.requires_grad
        tensor = tensor.detach().cpu()
        values = tensor.reshape(-1).to(torch.float32).contiguous()
        header = _HEADER.pack(_MAGIC, self.codec_id, _FORMAT_VERSION, self.format.table_checksum(), self.block_size)
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=header + (self.format.encode(values) if values.numel() else b""),
            size=tensor.shape,
            dtype=str(tensor.dtype).replace("torch.", ""),
            requires_grad=requires_grad,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        payload, numel, block_size = self._checked(serialized_tensor)
        values = torch.empty(0) if numel == 0 else self.format.decode(payload, numel, block_size)
        dtype = getattr(torch, serialized_tensor.dtype)
        return values.to(dtype).reshape(tuple(serialized_tensor.size)).requires_grad_(serialized_tensor.requires_grad)

    def extract_into(self, serialized_tensor: runtime_pb2.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`extract` written into `out` (flat contiguous fp32 holding exactly the message's values); `out`."""
        payload, numel, block_size = self._checked(serialized_tensor)
        if numel != out.numel():
            raise CodecMismatchError(f"{self.name} part of {numel} values where {out.numel()} were expected")
        return out if numel == 0 else self.format.decode_into(payload, numel, block_size, out)

    def _checked(self, serialized_tensor: runtime_pb2.Tensor) -> tuple[memoryview, int, int]:
        """The payload after our header, the value count and the sender's block size, once the header matches."""
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
        if checksum != self.format.table_checksum():
            raise CodecMismatchError(f"{self.name} payload quantized with another code table (bitsandbytes version?)")
        numel = math.prod(serialized_tensor.size)
        payload = memoryview(buffer)[_HEADER.size :]  # a slice of bytes would copy the part once more
        if (numel == 0) != (not payload) or (numel and self.block_size and not block_size):
            raise CodecMismatchError(f"{self.name} payload of {len(payload)} bytes for {numel} values")
        return payload, numel, block_size

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.bits_per_value / torch.finfo(info.descriptor.dtype).bits

    def __repr__(self) -> str:
        return f"p2p_diloco.net.codecs.FramedCodec({self.name})"


class Float16Codec(Float16Compression):
    """IEEE half precision, wire-compatible with hivemind's Float16Compression, also for bfloat16 input."""

    name, block_size, bits_per_value = "fp16", 0, 16.0

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        if tensor.dtype != torch.bfloat16:
            return super().compress(tensor, info, allow_inplace)
        message = super().compress(tensor.detach().to(torch.float32), info, allow_inplace=True)
        message.dtype, message.requires_grad = "bfloat16", tensor.requires_grad
        return message

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        if serialized_tensor.dtype not in ("float16", "bfloat16"):
            return super().extract(serialized_tensor)
        # hivemind's would return a view of the read-only message buffer, and knows no bfloat16
        half, _ = read_values(serialized_tensor.buffer, 0, math.prod(serialized_tensor.size), torch.float16)
        dtype = getattr(torch, serialized_tensor.dtype)
        return half.to(dtype).reshape(tuple(serialized_tensor.size)).requires_grad_(serialized_tensor.requires_grad)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.bits_per_value / torch.finfo(info.descriptor.dtype).bits

    def __repr__(self) -> str:
        return "p2p_diloco.net.codecs.Float16Codec()"


class Float32Codec(NoCompression):
    """No compression: the fp32 buffer travels as is (hivemind's NoCompression, under a name)."""

    name, block_size, bits_per_value = "fp32", 0, 32.0

    def __repr__(self) -> str:
        return "p2p_diloco.net.codecs.Float32Codec()"


def _wire_codec(name: str) -> CompressionBase:
    if name == "fp32":
        return Float32Codec()
    return Float16Codec() if name == "fp16" else FramedCodec(quantizer(name))


CODECS: dict[str, CompressionBase] = {name: _wire_codec(name) for name in CODEC_NAMES}
"""Codec instances by name (the names of `p2p_diloco.diloco.quantize.CODEC_NAMES`)."""


class SharedSlot(CompressionBase):
    """Several of our framed codecs in one enum slot (hivemind's enum has six values, we have seven codecs).

    Parts are decoded by the codec id in their frame; reducers re-encode merged parts with `active`, the codec of
    this process's island: the members of a group always share one codec (matchmaking keys on it).
    """

    def __init__(self, codecs: list[FramedCodec]) -> None:
        super().__init__()
        self.by_id = {codec.codec_id: codec for codec in codecs}
        self.active = codecs[0]
        self.compression_type = codecs[0].compression_type

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        return self.active.compress(tensor, info, allow_inplace)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        buffer = serialized_tensor.buffer
        framed = len(buffer) >= _HEADER.size and buffer[: len(_MAGIC)] == _MAGIC
        codec_id = _HEADER.unpack_from(buffer)[1] if framed else None
        return self.by_id.get(codec_id, self.active).extract(serialized_tensor)  # else `active` names the mismatch

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.active.estimate_compression_ratio(info)

    def __repr__(self) -> str:
        return f"p2p_diloco.net.codecs.SharedSlot({', '.join(c.name for c in self.by_id.values())})"


SHARED_SLOTS = {"MEANSTD_16BIT": SharedSlot([CODECS["int2"], CODECS["topk"]])}
"""The slots that hold more than one codec."""

_STOCK_OCCUPANTS = {
    "FLOAT16": "Float16Compression",
    "BLOCKWISE_8BIT": "BlockwiseQuantization",
    "UNIFORM_8BIT": "Uniform8BitQuantization",
    "QUANTILE_8BIT": "Quantile8BitQuantization",
    "MEANSTD_16BIT": "ScaledFloat16Compression",
}


def install() -> None:
    """Put our codecs into hivemind's compression registry (idempotent; done when this module is imported).

    The registry is private to hivemind, but it is the only way the reducers and receivers of an all-reduce learn
    how to decode a part. Refuses to overwrite a slot that someone else has already replaced.
    """
    registry = _serialization._BASE_COMPRESSION_TYPES
    for codec in CODECS.values():
        slot = runtime_pb2.CompressionType.Name(codec.compression_type)
        if slot == "NONE":
            continue  # hivemind's NoCompression already is our fp32 codec
        occupant = SHARED_SLOTS.get(slot, codec)
        current = registry[slot]
        if current is occupant:
            continue
        if type(current).__name__ != _STOCK_OCCUPANTS[slot] or type(current).__module__.split(".")[0] != "hivemind":
            raise RuntimeError(f"hivemind compression slot {slot} already holds {current!r}; cannot install {codec!r}")
        registry[slot] = occupant


install()


def get_compression(name: str, topk_bits: int | None = None) -> CompressionBase:
    """The codec `name` as a hivemind CompressionBase (for GossipExchange(compression=...)).

    Call it before the averager process starts: the blockwise codecs load their kernels here (int8 also imports
    bitsandbytes for its code table: seconds) so that the forked averager inherits them instead of compiling or
    importing in the middle of its first all-reduce. It also
    makes `name` the codec its slot re-encodes with when the slot is shared, and sets topk's value bits.
    """
    quantizer(name)  # the one-line error for an unknown name
    install()
    codec = CODECS[name]
    slot = SHARED_SLOTS.get(runtime_pb2.CompressionType.Name(codec.compression_type))
    if slot is not None:
        slot.active = codec
    if topk_bits is not None:
        quantizer("topk").value_bits = topk_bits
    if isinstance(codec, FramedCodec):
        codec.warm_up()
    return codec


def decode_into(message: runtime_pb2.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A part's values written into `out` (flat contiguous fp32 of the part's size), decoded in place where the
    codec can (ours) and copied otherwise; `out`. Raises what decoding raises, also for a part of another size."""
    codec = _serialization._BASE_COMPRESSION_TYPES[runtime_pb2.CompressionType.Name(message.compression)]
    if isinstance(codec, FramedCodec) and message.dtype == "float32":
        return codec.extract_into(message, out)
    values = _serialization.deserialize_torch_tensor(message)
    if values.numel() != out.numel():
        raise CodecMismatchError(f"a part of {values.numel()} values where {out.numel()} were expected")
    return out.copy_(values.reshape(-1))


def bits_per_value(name: str) -> float:
    """Bits on the wire per fp32 value, block scales included (frame headers of 12 bytes per part excluded)."""
    return float(quantizer(name).bits_per_value)


def round_trip(compression: CompressionBase | str, tensor: torch.Tensor) -> torch.Tensor:
    """What peers decode when `tensor` is sent as one part with `compression`, in fp32."""
    codec = get_compression(compression) if isinstance(compression, str) else compression
    message = codec.compress(tensor.detach(), CompressionInfo.from_tensor(tensor))
    return codec.extract(message).to(torch.float32)


def strangers(
    ours: Mapping[str, Any], others: Mapping[str, Mapping[str, Any]], keys: tuple[str, ...] = ("fingerprint", "codec")
) -> dict[str, dict[str, Any]]:
    """Islands whose announced model fingerprint or codec differs from ours: peer -> {key: what it announced}.

    The one agreement check, used at join (on the run's records) and after every round (on the gathered metadata).
    """
    found = {}
    for peer, data in others.items():
        differs = {key: data.get(key) for key in keys if data.get(key) != ours.get(key)}
        if differs:
            found[peer] = differs
    return found


def describe_strangers(ours: Mapping[str, Any], found: Mapping[str, Mapping[str, Any]]) -> str:
    """One line naming each stranger and what it announced against what this island uses."""
    parts = []
    for peer, differs in found.items():
        what = ", ".join(f"{key} {value!r} (this island: {ours.get(key)!r})" for key, value in differs.items())
        parts.append(f"island {peer} announces {what}")
    return "; ".join(parts)


def schema_hash_with_codec(schema_hash: bytes, name: str, protocol: int | None = None) -> bytes:
    """An averager's schema hash that also names the codec (and the wire protocol, if given), so that matchmaking
    refuses islands of another codec or protocol version.

    hivemind's leaders reject a follower whose schema hash differs (BAD_SCHEMA_HASH) before any all-reduce starts;
    without this, members of different codecs cut the vector into parts of different sizes and the round fails at
    the reducers only after timeouts (or, with one part each, succeeds with members holding different bits).
    """
    quantizer(name)
    protocol_tag = b"" if protocol is None else f"|protocol={protocol}".encode()
    return hashlib.sha1(schema_hash + b"|codec=" + name.encode() + protocol_tag).digest()
