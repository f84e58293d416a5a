"""What a codec costs in CPU alone: milliseconds per million values to encode and to decode, on one core.

The same `p2p_diloco.diloco.quantize` code the averager runs, timed in this process on a Gaussian vector, so that
a round's codec work can be set beside its seconds: a peer encodes about N values per round (its parts for the
other reducers, then the part it averaged) and decodes about 2 (M - 1) / M x N (what it reduces, then what the
other reducers return).
"""

from __future__ import annotations

import time

import torch

from p2p_diloco.diloco.quantize import quantizer

CODECS = ("int8", "int4", "int2")
VALUES = 2_000_000


def _best_ms(action, repeats: int) -> float:
    """The fastest of `repeats` timed calls, in ms (the others were slowed by something else on the machine)."""
    action()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def codec_ms_per_million(codecs: tuple[str, ...] = CODECS, values: int = VALUES, repeats: int = 3) -> dict:
    """{codec: {"encode": ms, "decode": ms}} per million values, on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        vector = torch.randn(values, generator=torch.Generator().manual_seed(0))
        costs = {}
        for name in codecs:
            codec = quantizer(name)
            payload = codec.encode(vector)
            encode = _best_ms(lambda codec=codec: codec.encode(vector), repeats)
            decode = _best_ms(
                lambda codec=codec, payload=payload: codec.decode(payload, values, codec.block_size), repeats
            )
            costs[name] = {"encode": encode * 1e6 / values, "decode": decode * 1e6 / values}
        costs["hivemind_int8"] = _stock_int8_ms(vector, repeats)
        return costs
    finally:
        torch.set_num_threads(threads)


def _stock_int8_ms(vector: torch.Tensor, repeats: int) -> dict:
    """hivemind's own int8 codec (`lib.stock_int8`, bitsandbytes), as the stock-hivemind rows run it."""
    from hivemind.compression import CompressionInfo

    from lib.stock_int8 import StockInt8

    codec, info = StockInt8(), CompressionInfo.from_tensor(vector)
    message = codec.compress(vector, info)
    encode = _best_ms(lambda: codec.compress(vector, info), repeats)
    decode = _best_ms(lambda: codec.extract(message), repeats)
    return {"encode": encode * 1e6 / vector.numel(), "decode": decode * 1e6 / vector.numel()}


def round_codec_s(costs: dict, codec: str, values: int, peers: int) -> float:
    """Seconds of one peer's codec work in an all-reduce of `values` among `peers` (encode N, decode 2(M-1)/M N)."""
    cost = costs[codec]
    return (cost["encode"] * values + cost["decode"] * 2 * (peers - 1) / peers * values) / 1e9
