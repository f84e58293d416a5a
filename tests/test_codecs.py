"""Codec round trips, error bounds, NaN poison, wire format, error feedback and codec agreement (no network).

Error bounds are measured on N(0,1) values (100_003 of them, seeded) and hold with margin:

    codec  relative L2 error (measured)  bound here  why
    fp32   0                             exact       no compression
    fp16   2.1e-4                        3e-4        round to nearest, 11-bit significand: per value <= 2^-11
    bf16   1.7e-3                        2.5e-3      8-bit significand: per value <= 2^-8
    int8   1.1e-2                        1.4e-2      bitsandbytes dynamic map, 256-value blocks: per value <= half
                                                     the widest gap of the map x block absmax (+1%: see below)
    int4   9.6e-2                        0.11        NF4, 128-value blocks: per value <= half the widest NF4 gap
                                                     (0.139) x block absmax
    int2   0.34                          0.36        Lloyd-Max levels x block RMS: inside the outer levels per
                                                     value <= half the widest gap (0.53) x RMS, beyond them
                                                     the distance to the outer level (the Gaussian optimum,
                                                     sqrt(0.1175) = 0.343)
    topk   0.76 on dense data                    0.8         a sparse format: every nonzero kept, its magnitude
                                                     one of the 2 ends of its block's range (2-bit); on
                                                     sparsified vectors 0.14 (tested in test_sparse.py)
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hivemind.compression import (
    CompressionInfo,
    NoCompression,
    ScaledFloat16Compression,
    Uniform8BitQuantization,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from hivemind.compression import serialization as hivemind_serialization
from hivemind.proto import runtime_pb2

from p2p_diloco.diloco.error_feedback import ErrorFeedback
from p2p_diloco.diloco.quantize import QUANTIZERS
from p2p_diloco.diloco.sparse import topk_sparsify
from p2p_diloco.net.codecs import (
    CODECS,
    SHARED_SLOTS,
    CodecMismatchError,
    bits_per_value,
    describe_strangers,
    get_compression,
    install,
    round_trip,
    schema_hash_with_codec,
    strangers,
)

SIZES = [1, 2, 127, 4095, 4097, 100_003]  # block sizes are 128 (int4) and 256 (int8)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
L2_BOUND = {"fp32": 0.0, "fp16": 3e-4, "bf16": 2.5e-3, "int8": 1.4e-2, "int4": 0.11, "int2": 0.36, "topk": 0.8}


def gaussian(size: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(seed))


def relative_error(decoded: torch.Tensor, original: torch.Tensor) -> float:
    return float((decoded.float() - original.float()).norm() / original.float().norm())


def block_absmax(values: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each value's block absmax (blocks start at the tensor's first value)."""
    blocks = -(-values.numel() // block_size)
    padded = torch.zeros(blocks * block_size)
    padded[: values.numel()] = values.abs()
    return padded.view(blocks, block_size).amax(dim=1).repeat_interleave(block_size)[: values.numel()]


def block_half_range(magnitudes: torch.Tensor, block_size: int) -> torch.Tensor:
    """Half of each value's block range, max - min (blocks of consecutive values; the last may be short)."""
    rows = []
    for start in range(0, magnitudes.numel(), block_size):
        block = magnitudes[start : start + block_size]
        rows.append(((block.max() - block.min()) / 2).expand(block.numel()))
    return torch.cat(rows)


def block_rms(values: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each value's block RMS over the values the block holds (the last block may be short)."""
    rows = []
    for start in range(0, values.numel(), block_size):
        block = values[start : start + block_size]
        rows.append(block.square().mean().sqrt().expand(block.numel()))
    return torch.cat(rows)


def per_value_bound(name: str, values: torch.Tensor) -> torch.Tensor:
    """The largest error each value may get from codec `name` (round to nearest)."""
    codec = CODECS[name]
    if name == "fp32":
        return torch.zeros_like(values)
    if name == "fp16":  # 2^-11 relative in the normal range, half the subnormal spacing 2^-24 below it
        return torch.maximum(values.abs() * 2.0**-11, torch.full_like(values, 2.0**-25))
    if name == "bf16":
        return values.abs() * 2.0**-8
    if name == "topk":  # magnitudes rounded to the nearer end of their block's range (blocks of 128 nonzeros)
        levels = (1 << (codec.format.value_bits - 1)) - 1
        return block_half_range(values.abs(), 128) / levels * (1 + 2.0**-20) + 2.0**-30
    code = codec._code_table()
    half_gap = float((code.sort().values.diff().max()) / 2)
    if name == "int2":
        rms = block_rms(values, codec.block_size)
        beyond = values.abs() - float(code.abs().max()) * rms  # outside the outer levels: clipped to them
        return torch.maximum(rms * half_gap, beyond) * (1 + 2.0**-20) + 2.0**-30
    if name == "int8":  # bitsandbytes' CPU search takes the second-nearest code for ~0.15% of values that sit
        half_gap *= 1.01  # within a hair of a midpoint: their error exceeds half the gap by up to 0.3%
    return block_absmax(values, codec.block_size) * (half_gap + 2.0**-20)  # + fp32 rounding of the scaling


# ----- round trips -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", list(CODECS))
def test_round_trip_of_fp32_is_within_the_per_value_bound(name: str, size: int) -> None:
    values = gaussian(size, seed=size)
    decoded = round_trip(name, values)
    assert decoded.dtype == torch.float32 and decoded.shape == values.shape
    excess = (decoded - values).abs() - per_value_bound(name, values)
    assert float(excess.max()) <= 0, f"{name}: {int((excess > 0).sum())} values beyond the bound"
    if size >= 4095:
        assert relative_error(decoded, values) <= L2_BOUND[name]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CODECS))
def test_round_trip_keeps_dtype_and_shape_and_codes_in_fp32(name: str, dtype: torch.dtype, size: int) -> None:
    codec = get_compression(name)
    values = gaussian(size, seed=size).to(dtype)
    decoded = codec.extract(codec.compress(values, CompressionInfo.from_tensor(values)))
    assert decoded.dtype == dtype and decoded.shape == values.shape
    # Every codec works on the fp32 value of its input: same result as coding the fp32 copy, cast back.
    via_fp32 = codec.extract(codec.compress(values.float(), CompressionInfo.from_tensor(values.float())))
    assert torch.equal(decoded, via_fp32.to(dtype))
    if size >= 4095:
        assert relative_error(decoded, values) <= max(L2_BOUND[name], 2e-3 if dtype == torch.bfloat16 else 0)


@pytest.mark.parametrize("name", list(CODECS))
def test_multidimensional_tensors_keep_their_shape(name: str) -> None:
    values = gaussian(3 * 5 * 7).view(3, 5, 7)
    decoded = round_trip(name, values)
    assert decoded.shape == (3, 5, 7)
    assert float(((decoded - values).abs() - per_value_bound(name, values.reshape(-1)).view(3, 5, 7)).max()) <= 0


def test_int4_rounds_to_the_nearest_nf4_level() -> None:
    codec = CODECS["int4"]
    values = gaussian(4097, seed=3)
    scale = block_absmax(values, codec.block_size)
    levels = codec._code_table()
    nearest = levels[(values[:, None] / scale[:, None] - levels[None, :]).abs().argmin(dim=1)] * scale
    torch.testing.assert_close(round_trip(codec, values), nearest, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", list(CODECS))
def test_zero_and_constant_tensors(name: str) -> None:
    zeros = round_trip(name, torch.zeros(4097))
    assert torch.equal(zeros, torch.zeros(4097))
    for constant in (0.37, -2.5e-7, 1234.5):
        values = torch.full((4097,), constant)
        decoded = round_trip(name, values)
        # The block absmax itself is coded exactly, except by int8 for negative values: bitsandbytes' signed
        # dynamic map ends at -0.993, not -1.
        if name in ("fp32", "int4", "topk") or (name == "int8" and constant > 0):
            assert torch.equal(decoded, values), (name, constant)
        else:
            assert float((decoded - values).abs().max()) <= float(per_value_bound(name, values).max())


@pytest.mark.parametrize("name", ["bf16", "int8", "int4", "int2"])
def test_relative_error_does_not_depend_on_scale(name: str) -> None:
    values = gaussian(100_003)
    errors = [relative_error(round_trip(name, values * scale), values * scale) for scale in (1e-6, 1.0, 1e6)]
    assert max(errors) <= min(errors) * 1.01 + 1e-9, errors  # fp16 is not: it underflows below 6e-5


def test_empty_tensor() -> None:
    for name in CODECS:
        assert round_trip(name, torch.zeros(0)).shape == (0,)


# ----- NaN: the strict all-reduce's poison must survive coding ----------------------------------------------
@pytest.mark.parametrize("name", list(CODECS))
def test_nan_survives_coding(name: str) -> None:
    values = gaussian(4097)
    values[300] = float("nan")
    decoded = round_trip(name, values)
    assert torch.isnan(decoded[300])
    poisoned = round_trip(name, torch.full((4097,), float("nan")))  # what a poisoned reducer returns
    assert torch.isnan(poisoned).all()


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_a_non_finite_value_poisons_exactly_its_block(name: str) -> None:
    block = CODECS[name].block_size
    values = gaussian(4 * block + 5)
    values[block + 3] = float("nan")
    values[3 * block] = float("inf")
    decoded = round_trip(name, values)
    bad_blocks = torch.zeros(5, dtype=torch.bool)
    bad_blocks[[1, 3]] = True
    expected_nan = bad_blocks.repeat_interleave(block)[: values.numel()]
    assert torch.equal(torch.isnan(decoded), expected_nan)


# ----- wire format and hivemind's registry --------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CODECS))
def test_the_all_reduce_path_uses_our_codec(name: str) -> None:
    """Reducers and receivers decode and re-encode through hivemind's registry, by the enum in the message."""
    codec = get_compression(name)
    values = gaussian(4097)
    message = serialize_torch_tensor(values, codec.compression_type)
    assert message.compression == codec.compression_type
    assert torch.equal(deserialize_torch_tensor(message), round_trip(codec, values))


@pytest.mark.parametrize("name", list(CODECS))
def test_bits_on_the_wire(name: str) -> None:
    codec = get_compression(name)
    values = gaussian(100_003)
    if name == "topk":  # islands sparsify before they send; its bits per value are nominal (2%, 2-bit)
        values = topk_sparsify(values, 0.02)
    message = codec.compress(values, CompressionInfo.from_tensor(values))
    payload_bits = 8 * len(message.buffer)
    expected = bits_per_value(name) * values.numel()
    assert expected <= payload_bits <= expected + 8 * 64 or (name == "topk" and abs(payload_bits / expected - 1) < 0.05)
    # hivemind sizes the all-reduce's parts with this ratio
    assert codec.estimate_compression_ratio(CompressionInfo.from_tensor(values)) == bits_per_value(name) / 32


def test_install_replaces_only_slots_hivemind_cannot_use_and_the_unused_one() -> None:
    install()  # idempotent
    registry = hivemind_serialization._BASE_COMPRESSION_TYPES
    for codec in CODECS.values():
        slot = runtime_pb2.CompressionType.Name(codec.compression_type)
        if slot != "NONE":
            assert registry[slot] is SHARED_SLOTS.get(slot, codec)
    assert type(registry["NONE"]) is NoCompression
    assert type(registry["MEANSTD_16BIT"]) is not ScaledFloat16Compression  # unused here: int2 holds it
    assert registry["MEANSTD_16BIT"] is SHARED_SLOTS["MEANSTD_16BIT"]  # int2 and topk: decoded by frame id
    assert len({codec.compression_type for codec in CODECS.values()}) == len(CODECS) - 1


@pytest.mark.skipif(int(np.__version__.split(".")[0]) < 2, reason="hivemind's 8-bit codecs break with numpy 2 only")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_hivemind_8bit_codecs_cannot_decode_under_numpy_2() -> None:
    """Why we take over their slots: inside an all-reduce this failure is silent (the tensor is not averaged)."""
    stock = Uniform8BitQuantization()
    values = gaussian(1000)
    with pytest.raises(TypeError):
        stock.extract(stock.compress(values, CompressionInfo.from_tensor(values)))


def test_foreign_bytes_in_our_slots_are_refused() -> None:
    values = gaussian(1000)
    stock = Uniform8BitQuantization().compress(values, CompressionInfo.from_tensor(values))  # a stock peer's part
    with pytest.raises(CodecMismatchError, match="not in p2p_diloco's int4 format"):
        deserialize_torch_tensor(stock)
    relabeled = CODECS["int8"].compress(values, CompressionInfo.from_tensor(values))
    relabeled.compression = CODECS["int4"].compression_type  # int8 bytes under int4's enum
    with pytest.raises(CodecMismatchError, match="expected int4"):
        deserialize_torch_tensor(relabeled)
    truncated = CODECS["int4"].compress(values, CompressionInfo.from_tensor(values))
    truncated.buffer = truncated.buffer[:-10]
    with pytest.raises(CodecMismatchError):
        deserialize_torch_tensor(truncated)


# ----- error feedback ------------------------------------------------------------------------------------------
def _accumulated_errors(name: str, rounds: int, feedback: bool) -> list[float]:
    """Relative error of the running sum of what was sent vs the running sum of the true deltas."""
    generator = torch.Generator().manual_seed(7)
    bias = torch.randn(4097, generator=generator) * 0.05  # a slow component every round shares
    ef = ErrorFeedback() if feedback else None
    true_sum, sent_sum, errors = torch.zeros(4097), torch.zeros(4097), []
    for _ in range(rounds):
        delta = torch.randn(4097, generator=generator) + bias
        send = ef.compensate(delta) if ef else delta
        decoded = round_trip(name, send)
        if ef:
            ef.update(decoded, send)
        true_sum += delta
        sent_sum += decoded
        errors.append(relative_error(sent_sum, true_sum))
    return errors


@pytest.mark.parametrize("name", ["bf16", "int8", "int4"])
def test_error_feedback_keeps_the_accumulated_error_bounded(name: str) -> None:
    without = _accumulated_errors(name, 30, feedback=False)
    with_feedback = _accumulated_errors(name, 30, feedback=True)
    # Without feedback the errors add up (about sqrt(rounds) x one round's); with it the running sum is off by
    # only the last residual, so its relative error shrinks as the sum grows.
    assert with_feedback[-1] < 0.3 * without[-1], (with_feedback[-1], without[-1])
    assert with_feedback[-1] < with_feedback[0]


def test_error_feedback_transmits_values_below_the_codec_resolution() -> None:
    """Values under int4's smallest level in their block (0.08 x absmax) are lost every round without feedback."""
    delta = torch.full((128,), 0.05)
    delta[0] = 10.0
    ef = ErrorFeedback()
    plain_total, fed_total = torch.zeros(128), torch.zeros(128)
    for _ in range(30):
        plain_total += round_trip("int4", delta)
        compensated = ef.compensate(delta)
        sent = round_trip("int4", compensated)
        ef.update(sent, compensated)
        fed_total += sent
    assert torch.equal(plain_total[1:], torch.zeros(127))  # 30 x 0.05 = 1.5 per value never sent
    assert float((fed_total[1:] - 1.5).abs().max()) < 0.5


def test_error_feedback_telescopes() -> None:
    ef, codec = ErrorFeedback(), CODECS["int4"]
    deltas = [gaussian(1000, seed=seed) for seed in range(5)]
    sent_total = torch.zeros(1000, dtype=torch.float64)
    for delta in deltas:
        compensated = ef.compensate(delta)
        sent = round_trip(codec, compensated)
        ef.update(sent, compensated)
        sent_total += sent.double()
    expected = torch.stack(deltas).double().sum(dim=0) - ef.residual.double()
    torch.testing.assert_close(sent_total, expected, rtol=0, atol=1e-5)


def test_error_feedback_state() -> None:
    ef = ErrorFeedback()
    delta = torch.ones(4, dtype=torch.bfloat16)
    compensated = ef.compensate(delta)
    assert compensated.dtype == torch.float32 and compensated is not delta
    ef.update(torch.zeros(4), compensated)
    assert torch.equal(ef.compensate(torch.ones(4)), torch.full((4,), 2.0))
    with pytest.raises(ValueError):
        ef.compensate(torch.ones(5))
    ef.update(torch.full((4,), float("nan")), compensated)  # never carry NaN into later rounds
    assert ef.residual is None
    ef.update(torch.zeros(4), compensated)
    ef.clear()
    assert torch.equal(ef.compensate(torch.ones(4)), torch.ones(4))


# ----- agreeing on the codec -------------------------------------------------------------------------------------
def test_strangers_are_found_and_named_in_one_line() -> None:
    ours = {"fingerprint": "f1", "codec": "int8"}
    assert strangers(ours, {"A": {"fingerprint": "f1", "codec": "int8", "weight": 1.0}}) == {}
    assert strangers(ours, {}) == {}
    found = strangers(ours, {"A": {"fingerprint": "f1", "codec": "int4"}, "B": {"fingerprint": "f2", "codec": "int8"}})
    assert found == {"A": {"codec": "int4"}, "B": {"fingerprint": "f2"}}
    message = describe_strangers(ours, found)
    assert "\n" not in message
    assert message == (
        "island A announces codec 'int4' (this island: 'int8'); island B announces fingerprint 'f2' (this island: 'f1')"
    )
    assert strangers(ours, {"C": {}}) == {"C": {"fingerprint": None, "codec": None}}


def test_every_wire_codec_carries_its_pure_format() -> None:
    assert list(CODECS) == list(QUANTIZERS)
    values = gaussian(4097)
    for name in CODECS:
        assert torch.equal(round_trip(name, values), QUANTIZERS[name].round_trip(values)), name


def test_unknown_codec_names() -> None:
    with pytest.raises(ValueError, match="unknown codec 'int3'; choose one of fp32, fp16, bf16, int8, int4"):
        get_compression("int3")
    with pytest.raises(ValueError, match="unknown codec"):
        bits_per_value("e3m0")


def test_schema_hash_names_the_codec() -> None:
    hashes = {schema_hash_with_codec(b"schema", name) for name in CODECS}
    assert len(hashes) == len(CODECS)
    assert schema_hash_with_codec(b"schema", "int8") == schema_hash_with_codec(b"schema", "int8")
    assert schema_hash_with_codec(b"other", "int8") != schema_hash_with_codec(b"schema", "int8")


def test_bits_per_value_table() -> None:
    assert {name: bits_per_value(name) for name in CODECS} == {
        "fp32": 32.0,
        "fp16": 16.0,
        "bf16": 16.0,
        "int8": 8.125,
        "int4": 4.25,
        "int2": 2.25,
        "topk": 0.02 * 9.6,
    }
    assert math.isclose(32 / bits_per_value("int4"), 7.53, rel_tol=1e-3)


def test_int8_starts_without_importing_bitsandbytes_or_asking_the_hub_for_kernels() -> None:
    import subprocess
    import sys

    # The code table is computed as bitsandbytes does (tests/test_kernels.py compares them): its import cost an int8
    # island 1.6 s of its start, and its CPU backend asks the Hugging Face Hub for a kernel (kernels.get_kernel).
    program = (
        "import sys, torch\n"
        "from p2p_diloco.diloco.quantize import quantizer\n"
        "codec = quantizer('int8'); codec.warm_up()\n"
        "values = torch.randn(1000)\n"
        "print('bitsandbytes' in sys.modules, 'kernels' in sys.modules,\n"
        "      float((codec.round_trip(values) - values).abs().max()) < 0.05)\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False", "True"]
    assert "kernels-community" not in done.stderr
