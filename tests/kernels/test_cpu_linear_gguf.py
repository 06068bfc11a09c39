"""The GGUF linear layer in C on both of its block families, kept packed: ggml's 32-weight
blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: their cases here) and the K-quants' 256-weight
super-blocks (Q4_K, Q5_K, Q6_K: their cases in test_cpu_linear_kquant.py). Against its
plain-torch reference and, bit for bit, against the float32 C linear layer over the same
weights dequantized, on this CPU's build and on the AVX2 build (`PDSERVE_CPU_ISA=avx2`, in a
child process); each row's output independent of the other rows of the call; the torch
dequantization against the `gguf` package's. Weights decoded to bf16 (bf16 dot products,
the 32-weight blocks): bit for bit the bf16 linear layer over a bf16 copy of the
dequantized weights. Rows of a packed matrix (`gguf_rows`, an embedding table's lookup):
its dequantized rows, rounded to the weight dtype.
"""

from __future__ import annotations

import functools
import sys

import numpy as np
import pytest
import torch

from pdserve.engine import gguf_file
from pdserve.kernels import gguf_blocks
from pdserve.kernels.cpu_quantized import CpuQuantizedLinear
from pdserve.kernels.gguf_blocks import (
    PACKED_TYPES,
    dequantize_rows,
    gguf_rows_ref,
    linear_gguf_ref,
)
from tests.kernels import test_cpu_linear_kquant as kquant
from tests.kernels.linear_checks import (
    TAIL_ROWS,
    assert_avx2_packed_grid,
    assert_dispatches_to,
    assert_packed_is_float32_linear,
    assert_rows_independent,
    cpu_has,
    packed_case,
)

# ggml numbers: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (the K-quants: test_cpu_linear_kquant.py)
TYPES = [2, 3, 6, 7, 8]
# (rows, weight rows, k, bias, threads): every micro-kernel shape and its remainders,
# partial units and tiles, SmolLM2's widths, and a block of x rows past the first.
GRID = [
    (1, 24, 32, False, 1),
    (1, 25, 64, True, 2),
    (1, 960, 576, False, 2),  # SmolLM2's fused QKV at decode
    (2, 13, 96, True, 1),
    (3, 37, 160, False, 2),
    (4, 100, 576, True, 2),
    (5, 11, 64, False, 1),
    (7, 37, 1536, False, 2),  # SmolLM2's down projection width
    (13, 1, 64, True, 1),
    (97, 61, 224, False, 2),
    (300, 70, 576, False, 2),
]
# (a type, rows, weight rows, k): the call whose last rows must give alone what it gives.
ALONE = (3, 300, 130, 576)


def packed_weight(qtype: int, n: int, k: int, seed: int) -> torch.Tensor:
    """Random blocks with finite float16 scales (and Q4_1/Q5_1 minimums)."""
    gen = torch.Generator().manual_seed(seed)
    size = PACKED_TYPES[qtype][2]
    blocks = torch.randint(0, 256, (n, k // 32, size), generator=gen, dtype=torch.uint8)
    scales = (torch.randn(n, k // 32, 1, generator=gen) * 0.02).half().view(torch.uint8)
    blocks[..., 0:2] = scales
    if qtype in (3, 7):
        blocks[..., 2:4] = (
            (torch.randn(n, k // 32, 1, generator=gen) * 0.1).half().view(torch.uint8)
        )
    return blocks.reshape(n, -1)


case_tensors = functools.partial(packed_case, packed_weight)


def case_id(qtype: int, m: int, n: int, k: int, bias: bool, threads: int) -> str:
    return f"{gguf_blocks.type_name(qtype)}-m{m}n{n}k{k}-b{bias}-t{threads}"


# The checks below run both families, each a module with its TYPES, GRID, packed_weight,
# case_tensors and ALONE.
FAMILIES = [sys.modules[__name__], kquant]
WEIGHTS = {q: family.packed_weight for family in FAMILIES for q in family.TYPES}
ALL_TYPES = list(WEIGHTS)
GRID_CASES = [
    pytest.param(q, case, id=case_id(q, *case))
    for family in FAMILIES
    for q in family.TYPES
    for case in family.GRID
]
ROWS_ALONE = {q: family.ALONE[1:] for family in FAMILIES for q in family.TYPES}


@pytest.fixture(scope="module")
def op(kernels) -> CpuQuantizedLinear:
    return CpuQuantizedLinear(kernels)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=gguf_blocks.type_name)
def test_dequantization_is_the_gguf_packages(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    w = WEIGHTS[qtype](qtype, 7, 768, qtype)
    ours = dequantize_rows(w, qtype)
    theirs = dequantize(w.numpy(), GGMLQuantizationType(qtype))
    assert ours.shape == (7, 768) and np.array_equal(ours.numpy(), theirs)


def test_the_engine_and_the_kernels_name_the_same_block_types():
    assert gguf_file.PACKED_TYPES == PACKED_TYPES
    assert {PACKED_TYPES[q][1] for q in TYPES} == {gguf_blocks.BLOCK}
    assert {PACKED_TYPES[q][1] for q in kquant.TYPES} == {256}


@pytest.mark.parametrize(("qtype", "case"), GRID_CASES)
def test_packed_linear_is_the_float32_linear_of_its_dequantized_weights(
    kernels, op, threads, qtype, case
):
    m, n, k, bias, num_threads = case
    threads(num_threads)
    x, w, b = packed_case(WEIGHTS[qtype], qtype, m, n, k, bias)
    # Bit for bit the float32 path's arithmetic: a GGUF model's numbers are its float copy's.
    assert_packed_is_float32_linear(kernels, op, x, w, qtype, b)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=gguf_blocks.type_name)
def test_a_row_does_not_depend_on_the_other_rows(op, threads, qtype):
    x, w, b = packed_case(WEIGHTS[qtype], qtype, *ROWS_ALONE[qtype], True)
    assert_rows_independent(lambda rows: op.linear_gguf(rows, w, qtype, b), x, threads)


def test_strided_rows_leading_dims_and_other_dtypes(op):
    w = packed_weight(3, 30, 64, 1)
    wide = torch.randn(6, 200)
    x = wide[:, 8:72]  # rows 200 apart: read in place
    assert torch.equal(op.linear_gguf(x, w, 3), op.linear_gguf(x.contiguous(), w, 3))
    assert op.linear_gguf(torch.randn(2, 3, 64), w, 3).shape == (2, 3, 30)
    xb = x.to(torch.bfloat16)  # not float32: the reference computes it
    assert torch.equal(op.linear_gguf(xb, w, 3), linear_gguf_ref(xb, w, 3))
    assert op.linear_gguf(torch.empty(0, 64), w, 3).shape == (0, 30)
    q4_k = kquant.packed_weight(12, 8, 512, 3)
    assert op.linear_gguf(torch.empty(0, 512), q4_k, 12).shape == (0, 8)


def test_bad_arguments_get_one_line_errors(op):
    w = packed_weight(8, 8, 64, 2)
    x = torch.randn(2, 64)
    cases = [
        ((torch.randn(2, 32), w, 8), "x has 32 features, the Q8_0 weight rows hold 68 bytes"),
        ((x, w.float(), 8), "weight must be a 2-D uint8 matrix"),
        ((x, w, 15), "ggml type 15 is not a packed type"),
        ((x, w, 8, torch.ones(7)), r"bias must be \[8\]"),
        (
            (torch.randn(2, 256), kquant.packed_weight(12, 8, 512, 3), 12),
            "x has 256 features, the Q4_K weight rows hold 288",
        ),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message) as raised:
            op.linear_gguf(*args)
        assert "\n" not in str(raised.value)


def test_dispatch_sends_cpu_packed_linear_to_the_c_kernel(kernels):
    assert_dispatches_to("linear_gguf", CpuQuantizedLinear, linear_gguf_ref)
    assert_dispatches_to("gguf_rows", CpuQuantizedLinear, gguf_rows_ref)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=gguf_blocks.type_name)
def test_rows_are_the_dequantized_rows_in_the_weight_dtype(op, qtype, weight_dtype):
    k = 512 if qtype in kquant.TYPES else 96
    w = WEIGHTS[qtype](qtype, 40, k, qtype + 7)
    ids = torch.tensor([3, 0, 39, 3, 17])
    rows = op.gguf_rows(w, ids, qtype, weight_dtype)
    expected = dequantize_rows(w, qtype)[ids].to(weight_dtype).float()
    assert rows.dtype == torch.float32 and torch.equal(rows, expected)
    assert torch.equal(rows, gguf_rows_ref(w, ids, qtype, weight_dtype))


def test_rows_take_any_id_shape_and_refuse_ids_outside_the_matrix(op):
    w = packed_weight(3, 10, 64, 4)
    ids = torch.tensor([[9, 1], [0, 0]], dtype=torch.int32)
    rows = op.gguf_rows(w, ids, 3)
    assert rows.shape == (2, 2, 64) and torch.equal(rows[0, 0], dequantize_rows(w, 3)[9])
    assert op.gguf_rows(w, torch.empty(0, dtype=torch.int64), 3).shape == (0, 64)
    halves = op.gguf_rows(w, ids, 3, torch.float16)  # not a C weight dtype: the reference's
    assert torch.equal(halves, gguf_rows_ref(w, ids, 3, torch.float16))
    for bad, index in ((torch.tensor([2, 10]), 1), (torch.tensor([-1]), 0)):
        with pytest.raises(ValueError, match=rf"ids\[{index}\] is outside the matrix's rows"):
            op.gguf_rows(w, bad, 3)
    with pytest.raises(ValueError, match="ggml type 15 is not a packed type"):
        op.gguf_rows(w, ids, 15)


@pytest.mark.skipif(not cpu_has("avx2", "fma"), reason="the CPU has no AVX2")
@pytest.mark.parametrize("family", FAMILIES, ids=["blocks", "kquant"])
def test_the_avx2_build_is_the_float32_linear_of_the_dequantized_weights(family):
    """PDSERVE_CPU_ISA=avx2 (a child process: the build is per process) decodes 8 weights
    at a time; the same grid, bit for bit the float32 path, rows independent as well."""
    assert_avx2_packed_grid(family.__name__, family.ALONE)


@pytest.fixture
def bf16_dot(kernels):
    """The kernels with bf16 dot products on (skipped where the build or CPU has none)."""
    if not kernels.bf16_dot_available:
        pytest.skip("this build or CPU has no AVX512-BF16")
    before = kernels.bf16_dot
    kernels.bf16_dot = True
    yield kernels
    kernels.bf16_dot = before


@pytest.mark.parametrize(("qtype", "case"), GRID_CASES)
def test_bf16_weights_are_the_bf16_linear_of_the_dequantized_weights(
    bf16_dot, op, threads, qtype, case
):
    m, n, k, bias, num_threads = case
    threads(num_threads)
    x, w, b = packed_case(WEIGHTS[qtype], qtype, m, n, k, bias)
    y = op.linear_gguf(x, w, qtype, b, torch.bfloat16)
    # A GGUF model served in bfloat16 has the numbers of its bf16 copy: fewer than 4 rows
    # of 32-weight blocks decode blocks in registers, the rest a panel of rows first.
    halves = dequantize_rows(w, qtype).to(torch.bfloat16)
    assert torch.equal(y, bf16_dot.linear(x, halves, b))
    # The reference with x as the bf16 dot products take it: rounded to bf16.
    reference = linear_gguf_ref(x.to(torch.bfloat16).float(), w, qtype, b, torch.bfloat16)
    torch.testing.assert_close(y, reference, atol=1e-4 * k**0.5, rtol=1e-4)


@pytest.mark.parametrize("qtype", [3, 14], ids=gguf_blocks.type_name)
def test_bf16_weights_rows_do_not_depend_on_the_other_rows(bf16_dot, op, threads, qtype):
    """Tails of 1-3 rows (blocks decoded in registers) against the panels of the whole."""
    x, w, b = packed_case(WEIGHTS[qtype], qtype, *ROWS_ALONE[qtype], True)
    assert min(TAIL_ROWS) < 4 < max(TAIL_ROWS)
    assert_rows_independent(
        lambda rows: op.linear_gguf(rows, w, qtype, b, torch.bfloat16), x, threads
    )


def test_bf16_weights_without_bf16_dot_products_stay_float32(kernels, op):
    """Off the bf16 dot-product path the weights decode to float32, the exact values: the
    same numbers as weight dtype float32."""
    x, w, _ = packed_case(packed_weight, 3, 5, 24, 64, False)
    before = kernels.bf16_dot
    try:
        kernels.bf16_dot = False
        assert not op.bf16_panels(torch.bfloat16)
        assert torch.equal(op.linear_gguf(x, w, 3, None, torch.bfloat16), op.linear_gguf(x, w, 3))
    finally:
        kernels.bf16_dot = before
