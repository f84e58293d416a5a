"""hivemind's own int8 codec, for the stock-hivemind rows of exchange.py and link.py.

`BlockwiseQuantization` as hivemind 1.1 ships it: bitsandbytes' `quantize_blockwise` with blocks of 4096, the code
table sent in every part. Under numpy 2 its `extract` raises (it calls int() on a one-element array), so a hivemind
user with int8 gets no working codec at all; this is that codec with the one fix, installed in its own slot of
hivemind's registry (in the benchmark's stock-hivemind worker process only, where p2p-diloco's codec is not used).
"""

from __future__ import annotations

import numpy as np
import torch
from hivemind.compression import serialization
from hivemind.compression.quantization import _BLOCKWISE_QUANTIZATION_BLOCKSIZE, BlockwiseQuantization
from hivemind.proto import runtime_pb2


class StockInt8(BlockwiseQuantization):
    """hivemind's BlockwiseQuantization; `extract` is hivemind's, reading the two sizes with numpy 2's rules."""

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        from bitsandbytes.functional import dequantize_blockwise

        buffer = serialized_tensor.buffer
        absmax_size, codebook_size = (int(size) for size in np.frombuffer(buffer, count=2, dtype=np.int64))
        absmax = np.frombuffer(buffer, offset=16, count=absmax_size, dtype=self.codebook_dtype)
        codebook = np.frombuffer(buffer, offset=16 + absmax.nbytes, count=codebook_size, dtype=self.codebook_dtype)
        quantized = np.frombuffer(buffer, offset=16 + absmax.nbytes + codebook.nbytes, dtype=self.indices_dtype)
        result = dequantize_blockwise(
            torch.as_tensor(quantized).reshape(tuple(serialized_tensor.size)),
            absmax=torch.as_tensor(absmax),
            code=torch.as_tensor(codebook),
            blocksize=_BLOCKWISE_QUANTIZATION_BLOCKSIZE,
            nested=False,
        )
        return result.to(getattr(torch, serialized_tensor.dtype)).requires_grad_(serialized_tensor.requires_grad)


def install_stock_int8() -> StockInt8:
    """Put hivemind's own int8 codec back in its registry slot (this process only) and return it."""
    codec = StockInt8()
    serialization._BASE_COMPRESSION_TYPES[runtime_pb2.CompressionType.Name(codec.compression_type)] = codec
    codec.compress(torch.ones(8), serialization.CompressionInfo.from_tensor(torch.ones(8)))  # import bitsandbytes now
    return codec
