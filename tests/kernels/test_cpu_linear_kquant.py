"""The GGUF linear layer's K-quant super-blocks (Q4_K, Q5_K, Q6_K): their cases (types, grid,
random packed weights), which test_cpu_linear_gguf.py's checks run beside the 32-weight
blocks', and the tests' quantizer against the `gguf` package's dequantization.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from pdserve.kernels import gguf_blocks
from pdserve.kernels.gguf_blocks import dequantize_rows
from pdserve.kernels.gguf_kquants import KQUANT_TYPES
from tests.kernels.linear_checks import packed_case

TYPES = sorted(KQUANT_TYPES)  # ggml numbers: Q4_K, Q5_K, Q6_K
# (rows, weight rows, k, bias, threads): every micro-kernel shape and its remainders,
# partial 24-row units, one to six super-blocks a row, and x rows past a block of them.
GRID = [
    (1, 24, 256, False, 1),
    (1, 25, 512, True, 2),
    (1, 130, 1536, False, 2),
    (2, 13, 256, True, 1),
    (3, 37, 768, False, 2),
    (4, 100, 512, True, 2),
    (5, 11, 256, False, 1),
    (13, 1, 256, True, 1),
    (97, 61, 256, False, 2),
    (300, 30, 1024, True, 2),
]
# (a type, rows, weight rows, k): the call whose last rows must give alone what it gives.
ALONE = (14, 300, 50, 512)


def packed_weight(qtype: int, n: int, k: int, seed: int) -> torch.Tensor:
    """Random super-blocks (any scale bits, any values) with small finite float16 scales."""
    gen = torch.Generator().manual_seed(seed)
    size = KQUANT_TYPES[qtype][1]
    blocks = torch.randint(0, 256, (n, k // 256, size), generator=gen, dtype=torch.uint8)

    def halves() -> torch.Tensor:
        return (torch.randn(n, k // 256, 1, generator=gen) * 1e-3).half().view(torch.uint8)

    if qtype == 14:  # Q6_K: d last
        blocks[..., 208:210] = halves()
    else:  # d, dmin first
        blocks[..., 0:2] = halves()
        blocks[..., 2:4] = halves()
    return blocks.reshape(n, -1)


case_tensors = functools.partial(packed_case, packed_weight)


@pytest.mark.parametrize("qtype", TYPES, ids=gguf_blocks.type_name)
def test_the_tests_quantizer_writes_blocks_the_gguf_package_reads_back(qtype):
    """The K-quant files of the engine tests: their blocks decode to the weights within
    the format's step (an oracle for the layout the quantizer and the kernels share)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from tests.engine.kquant_blocks import quantize_kquant

    kind = GGMLQuantizationType(qtype)
    weight = np.random.default_rng(qtype).standard_normal((6, 512)).astype(np.float32)
    blocks = quantize_kquant(weight, kind)
    assert blocks.shape == (6, 2 * KQUANT_TYPES[qtype][1]) and blocks.dtype == np.uint8
    back = dequantize(blocks, kind)
    error = np.abs(back - weight).max() / np.abs(weight).max()
    assert error < {12: 0.12, 13: 0.07, 14: 0.05}[qtype], error
    assert np.array_equal(dequantize_rows(torch.from_numpy(blocks), qtype).numpy(), back)
