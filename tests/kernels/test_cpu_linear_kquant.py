"""The GGUF linear layer in C on K-quant super-blocks (Q4_K, Q5_K, Q6_K kept packed) against
its plain-torch reference and, bit for bit, against the float32 C linear layer over the
same weights dequantized, on this CPU's build and on the AVX2 build (`PDSERVE_CPU_ISA=avx2`,
in a child process); each row's output independent of the other rows of the call; the
torch dequantization against the `gguf` package's, and the tests' quantizer against it.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from pdserve.engine import gguf_file
from pdserve.kernels import gguf_blocks
from pdserve.kernels.cpu_quantized import CpuQuantizedLinear
from pdserve.kernels.gguf_blocks import PACKED_TYPES, dequantize_rows
from pdserve.kernels.gguf_kquants import KQUANT_TYPES
from tests.kernels.linear_checks import (
    assert_avx2_packed_grid,
    assert_packed_is_float32_linear,
    assert_rows_independent,
    cpu_has,
    packed_case,
)

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


@pytest.fixture(scope="module")
def op(kernels) -> CpuQuantizedLinear:
    return CpuQuantizedLinear(kernels)


@pytest.mark.parametrize("qtype", TYPES, ids=gguf_blocks.type_name)
def test_dequantization_is_the_gguf_packages(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    w = packed_weight(qtype, 7, 768, qtype)
    ours = dequantize_rows(w, qtype)
    theirs = dequantize(w.numpy(), GGMLQuantizationType(qtype))
    assert ours.shape == (7, 768) and np.array_equal(ours.numpy(), theirs)


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


def test_the_engine_and_the_kernels_name_the_same_block_types():
    assert gguf_file.PACKED_TYPES == PACKED_TYPES
    assert {gguf_file.PACKED_TYPES[q][1] for q in TYPES} == {256}


@pytest.mark.parametrize("qtype", TYPES, ids=gguf_blocks.type_name)
@pytest.mark.parametrize("case", GRID, ids=lambda c: f"m{c[0]}n{c[1]}k{c[2]}-b{c[3]}-t{c[4]}")
def test_packed_linear_is_the_float32_linear_of_its_dequantized_weights(
    kernels, op, threads, qtype, case
):
    m, n, k, bias, num_threads = case
    threads(num_threads)
    x, w, b = case_tensors(qtype, m, n, k, bias)
    # Bit for bit the float32 path's arithmetic: a GGUF model's numbers are its float copy's.
    assert_packed_is_float32_linear(kernels, op, x, w, qtype, b)


@pytest.mark.parametrize("qtype", TYPES, ids=gguf_blocks.type_name)
def test_a_row_does_not_depend_on_the_other_rows(op, threads, qtype):
    x, w, b = case_tensors(qtype, 300, 50, 512, True)
    assert_rows_independent(lambda rows: op.linear_gguf(rows, w, qtype, b), x, threads)


def test_a_k_off_the_super_blocks_gets_a_one_line_error(op):
    w = packed_weight(12, 8, 512, 3)
    with pytest.raises(ValueError, match="x has 256 features, the Q4_K weight rows hold 288"):
        op.linear_gguf(torch.randn(2, 256), w, 12)
    assert op.linear_gguf(torch.empty(0, 512), w, 12).shape == (0, 8)


@pytest.mark.skipif(not cpu_has("avx2", "fma"), reason="the CPU has no AVX2")
def test_the_avx2_build_is_the_float32_linear_of_the_dequantized_weights():
    """PDSERVE_CPU_ISA=avx2 (a child process: the build is per process) decodes 8 weights
    at a time; the same grid, bit for bit the float32 path, rows independent as well."""
    assert_avx2_packed_grid("tests.kernels.test_cpu_linear_kquant", (14, 300, 50, 512))
