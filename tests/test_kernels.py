"""The fused blockwise kernels behind int8, int4 and int2: nearest levels, exact decoding, the wire layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bnb_reference import bitsandbytes_functional

from p2p_diloco.diloco import kernels
from p2p_diloco.diloco.quantize import CodecMismatchError, quantizer


def nearest_level(values: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Brute force: the index of the nearest level, the lower one on a tie."""
    distance = np.abs(values[:, None].astype(np.float64) - levels[None, :].astype(np.float64))
    return distance.argmin(axis=1)


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_the_lookup_finds_the_nearest_level_everywhere_on_the_number_line(name: str) -> None:
    levels = quantizer(name).code_table().numpy()
    base, threshold = kernels.level_lookup(levels)
    rng = np.random.default_rng(0)
    keys = np.arange(1 << 16, dtype=np.uint32) << 16
    # both ends of every 16-bit interval, random points inside, the levels and the midpoints themselves
    bits = np.concatenate([keys, keys | 0xFFFF, keys | rng.integers(0, 1 << 16, keys.size, dtype=np.uint32)])
    values = bits.view(np.float32)
    midpoints = ((levels[1:].astype(np.float64) + levels[:-1]) / 2).astype(np.float32)
    values = np.concatenate([values[np.isfinite(values) & (np.abs(values) <= 4)], levels, midpoints])
    key = values.view(np.uint32) >> 16
    found = base[key].astype(np.int64) + (values > threshold[key])
    expected = nearest_level(values, levels)
    distance = np.abs(values.astype(np.float64)[:, None] - levels[None, :].astype(np.float64))
    chosen, best = distance[np.arange(values.size), found], distance[np.arange(values.size), expected]
    assert np.array_equal(chosen, best), "a value went to a level that is not the nearest"


def test_the_lookup_refuses_levels_too_close_for_a_16_bit_key() -> None:
    with pytest.raises(ValueError, match="closer than"):
        kernels.level_lookup(np.array([0.0, 0.5, 0.5001, 0.5002, 1.0], dtype=np.float32))
    with pytest.raises(ValueError, match="ascending"):
        kernels.level_lookup(np.array([1.0, 0.0], dtype=np.float32))


def test_the_int8_code_table_is_bitsandbytes_dynamic_map_bit_for_bit() -> None:
    reference = bitsandbytes_functional().create_dynamic_map(signed=True).to(torch.float32)
    assert torch.equal(quantizer("int8").code_table().view(torch.int32), reference.view(torch.int32))


def test_int8_keeps_bitsandbytes_scales_and_decoder_and_rounds_at_least_as_close() -> None:
    bnb = bitsandbytes_functional()
    codec = quantizer("int8")
    table = codec.code_table()
    values = torch.randn(100_003, generator=torch.Generator().manual_seed(1)) * torch.logspace(-6, 2, 100_003)
    payload = codec.encode(values)
    blocks = -(-values.numel() // 256)
    absmax = torch.frombuffer(bytearray(payload[: 4 * blocks]), dtype=torch.float32)
    codes = torch.frombuffer(bytearray(payload[4 * blocks :]), dtype=torch.uint8)
    theirs, state = bnb.quantize_blockwise(values, code=table, blocksize=256)
    assert torch.equal(absmax, state.absmax.float())
    ours_decoded = codec.decode(payload, values.numel(), 256)
    reference = bnb.dequantize_blockwise(codes, absmax=absmax, code=table, blocksize=256)
    assert torch.equal(ours_decoded.view(torch.int32), reference.view(torch.int32)), "decoding differs in bits"
    theirs_decoded = bnb.dequantize_blockwise(theirs, absmax=state.absmax, code=table, blocksize=256)
    assert torch.all((ours_decoded - values).abs() <= (theirs_decoded - values).abs() * (1 + 1e-6) + 1e-30)
    assert (codes == theirs).float().mean() > 0.99  # the same code but where bitsandbytes missed the nearest


@pytest.mark.parametrize(("name", "bits"), [("int8", 8), ("int4", 4), ("int2", 2)])
def test_codes_are_packed_first_value_in_the_high_bits_after_the_scales(name: str, bits: int) -> None:
    codec = quantizer(name)
    count = 2 * codec.block_size + 5  # two full blocks and a short one
    values = torch.randn(count, generator=torch.Generator().manual_seed(3))
    payload = codec.encode(values)
    blocks = 3
    scales = np.frombuffer(payload[: 4 * blocks], dtype=np.float32).repeat(codec.block_size)[:count]
    packed = np.frombuffer(payload[4 * blocks :], dtype=np.uint8)
    assert packed.size == -(-count * bits // 8)
    per_byte, mask = 8 // bits, (1 << bits) - 1
    index = np.arange(count)
    unpacked = (packed[index // per_byte] >> (bits * (per_byte - 1 - index % per_byte))) & mask
    levels = codec.code_table().numpy()
    assert np.array_equal(unpacked, nearest_level(values.numpy() / scales, levels))


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_decoding_is_level_times_scale_in_fp32(name: str) -> None:
    codec = quantizer(name)
    values = torch.randn(1000, generator=torch.Generator().manual_seed(2)) * 3
    payload = codec.encode(values)
    size, levels = codec.block_size, codec.code_table()
    blocks = -(-values.numel() // size)
    scales = torch.frombuffer(bytearray(payload[: 4 * blocks]), dtype=torch.float32)
    decoded = codec.decode(payload, values.numel(), size)
    per_value_scale = scales.repeat_interleave(size)[: values.numel()]
    codes = torch.from_numpy(nearest_level((values / per_value_scale).numpy(), levels.numpy()))
    expected = levels[codes] * per_value_scale
    assert torch.equal(decoded.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_a_payload_with_an_impossible_block_size_or_length_is_refused_not_read(name: str) -> None:
    codec = quantizer(name)
    payload = codec.encode(torch.randn(1000))
    for block_size in (0, -4, 3, 129 if name != "int8" else 0):
        with pytest.raises(CodecMismatchError):
            codec.decode(payload, 1000, block_size)
    with pytest.raises(CodecMismatchError):
        codec.decode(payload[:-1], 1000, codec.block_size)
    with pytest.raises(CodecMismatchError):
        codec.decode(payload, 100_000, codec.block_size)


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16", "int8", "int4", "int2", "topk"])
def test_a_part_decodes_into_place_bit_for_bit_as_it_extracts(name: str) -> None:
    from hivemind.compression import CompressionInfo

    from p2p_diloco.net.codecs import decode_into, get_compression

    codec = get_compression(name)
    values = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    if name == "topk":
        values[torch.rand(1000, generator=torch.Generator().manual_seed(5)) > 0.05] = 0.0
    message = codec.compress(values, CompressionInfo.from_tensor(values))
    extracted = codec.extract(message)
    target = torch.full((1000,), float("nan"))
    written = decode_into(message, target)
    assert written.data_ptr() == target.data_ptr()
    assert torch.equal(target.view(torch.int32), extracted.view(torch.int32))
    with pytest.raises(CodecMismatchError):
        decode_into(message, torch.empty(999))
