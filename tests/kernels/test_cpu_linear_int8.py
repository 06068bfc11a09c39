"""The weight-only int8 linear layer in C against a float64 product of the same int8
values and group scales and against its plain-torch reference, on this CPU's build
(AVX-512 here) and on the AVX2 build (`PDSERVE_CPU_ISA=avx2`, in a child process); each
row's output independent of the other rows of the call.

The grid walks row counts through every micro-kernel shape (1-4 rows and their
remainders), decode batches up to 32 and prefill chunks of hundreds of rows past the
first block, weight rows through partial units and tiles, K through the vector loop with
and without a partial last vector, and groups of 16 to 128 inputs or one per row.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.cpu_quantized import CpuQuantizedLinear
from pdserve.kernels.reference import linear_int8_ref
from tests.kernels.linear_checks import (
    assert_dispatches_to,
    assert_rows_independent,
    avx2_child_result,
    cpu_has,
)

BF16 = torch.bfloat16
# (rows, weight rows, k, inputs per scale (None: one scale per row), bias dtype, threads)
GRID = [
    (1, 24, 16, None, None, 1),
    (1, 25, 17, None, torch.float32, 2),  # one row past a unit; a 1-element last vector
    (1, 960, 576, 32, None, 2),  # SmolLM2's fused QKV at decode
    (1, 576, 1536, 32, torch.float32, 1),  # SmolLM2's down projection at decode
    (2, 12, 32, 16, BF16, 1),  # a group of one AVX-512 vector
    (3, 37, 40, None, None, 2),  # 3-row tiles; K past a vector by 8
    (4, 100, 576, 64, torch.float32, 2),
    (5, 11, 48, 16, BF16, 1),  # 4 + 1 rows; fewer weight rows than a unit
    (7, 37, 1536, 128, None, 2),  # 4 + 3 rows
    (8, 3072, 576, 32, None, 2),  # SmolLM2's fused gate/up at a decode batch of 8
    (13, 1, 64, 32, torch.float32, 1),  # a single weight row
    (32, 576, 576, 32, None, 2),  # SmolLM2's attention output at a decode batch of 32
    (64, 50, 5, None, None, 2),  # K below one vector
    (97, 61, 203, None, BF16, 2),  # a prefill chunk of odd sizes
    (300, 70, 576, 32, None, 2),  # more rows than one block of x
    (257, 96, 1536, 32, torch.float32, 2),  # a prefill chunk on the down projection
]


def case_tensors(m: int, n: int, k: int, group: int | None, bias_dtype: torch.dtype | None):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, k // (group or k), generator=gen) * 0.02 + 1e-3
    bias = None if bias_dtype is None else torch.randn(n, generator=gen).to(bias_dtype)
    return x, w, scales, bias


def exact(x, w, scales, bias) -> torch.Tensor:
    group = w.shape[1] // scales.shape[1]
    dequantized = w.double() * scales.double().repeat_interleave(group, dim=1)
    y = x.double() @ dequantized.T
    return y if bias is None else y + bias.double()


def tolerance(k: int) -> float:
    # float32 sums of k products of |x| ~ 1, |w| <= 127, times scales <= 0.021.
    return 127 * 0.021 * (1e-6 * k**0.5 + 1e-7 * k)


@pytest.fixture(scope="module")
def op(kernels) -> CpuQuantizedLinear:
    return CpuQuantizedLinear(kernels)


@pytest.mark.parametrize("case", GRID, ids=lambda c: f"m{c[0]}n{c[1]}k{c[2]}g{c[3]}-{c[4]}-t{c[5]}")
def test_int8_linear_matches_exact_product_and_reference(op, threads, case):
    m, n, k, group, bias_dtype, num_threads = case
    threads(num_threads)
    x, w, scales, bias = case_tensors(m, n, k, group, bias_dtype)
    y = op.linear_int8(x, w, scales, bias)
    assert y.shape == (m, n) and y.dtype == torch.float32
    expected = exact(x, w, scales, bias)
    torch.testing.assert_close(y.double(), expected, atol=tolerance(k), rtol=1e-5)
    reference = linear_int8_ref(x, w, scales, bias)
    torch.testing.assert_close(y, reference, atol=2 * tolerance(k), rtol=1e-5)


@pytest.mark.parametrize(("k", "group"), [(576, 32), (203, None)])
def test_a_row_does_not_depend_on_the_other_rows(op, threads, k, group):
    """Bit for bit: one row alone, inside any batch, at 1 or 2 threads."""
    x, w, scales, bias = case_tensors(300, 130, k, group, torch.float32)
    assert_rows_independent(lambda rows: op.linear_int8(rows, w, scales, bias), x, threads)


def test_strided_rows_leading_dims_and_other_dtypes(op):
    gen = torch.Generator().manual_seed(1)
    w = torch.randint(-127, 128, (30, 64), generator=gen, dtype=torch.int8)
    scales = torch.rand(30, 2, generator=gen)
    wide = torch.randn(6, 200, generator=gen)
    x = wide[:, 8:72]  # rows 200 apart: read in place
    torch.testing.assert_close(
        op.linear_int8(x, w, scales).double(), exact(x, w, scales, None), atol=1e-3, rtol=1e-5
    )
    x3 = torch.randn(2, 3, 64, generator=gen)
    assert op.linear_int8(x3, w, scales).shape == (2, 3, 30)
    xb = x.to(BF16)  # not float32: the reference computes it
    assert torch.equal(op.linear_int8(xb, w, scales), linear_int8_ref(xb, w, scales))
    assert op.linear_int8(torch.empty(0, 64), w, scales).shape == (0, 30)


def test_bad_arguments_get_one_line_errors(op):
    w = torch.randint(-127, 128, (8, 64), dtype=torch.int8)
    scales = torch.ones(8, 2)
    x = torch.randn(2, 64)
    groups = r"scales must be float32 \[8, K / G\] for a group size G dividing K = 64"
    cases = [
        ((torch.randn(2, 32), w, scales), "x has 32 features, weight expects 64"),
        ((x, w.float(), scales), "weight must be a 2-D int8 matrix"),
        ((x, w, torch.ones(7, 2)), groups),
        ((x, w, scales.double()), groups),
        ((x, w, torch.ones(8)), groups),  # per-row scales are [N, 1]
        ((x, w, torch.ones(8, 3)), groups),  # 64 inputs do not split in 3 groups
        ((x, w, torch.ones(8, 8)), "a group of 8 inputs is not a multiple of 16"),
        ((x, w, torch.ones(2, 8).T), "scales must be contiguous"),
        ((x, w, scales, torch.ones(7)), r"bias must be \[8\]"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message) as raised:
            op.linear_int8(*args)
        assert "\n" not in str(raised.value)
    with pytest.raises(ValueError, match="a group of 8 inputs"):  # the reference alike
        linear_int8_ref(x, w, torch.ones(8, 8))


def test_dispatch_sends_cpu_int8_linear_to_the_c_kernel(kernels):
    chosen = assert_dispatches_to("linear_int8", CpuQuantizedLinear, linear_int8_ref)
    x = torch.randn(2, 64)
    w = torch.randint(-127, 128, (8, 64), dtype=torch.int8)
    scales = torch.rand(8, 4)
    expected = exact(x, w, scales, None)
    torch.testing.assert_close(chosen(x, w, scales).double(), expected, atol=1e-3, rtol=1e-5)


@pytest.mark.skipif(not cpu_has("avx2", "fma"), reason="the CPU has no AVX2")
def test_the_avx2_build_matches_exact_products():
    """PDSERVE_CPU_ISA=avx2 (a child process: the build is per process) runs the 8-lane
    path on the same grid, within the same bounds, rows independent as well."""
    code = (
        "import json, torch, sys\n"
        "from pdserve.kernels import cpu_ops\n"
        "from pdserve.kernels.cpu_quantized import CpuQuantizedLinear\n"
        "from tests.kernels.test_cpu_linear_int8 import GRID, case_tensors, exact\n"
        "k = cpu_ops.load(); op = CpuQuantizedLinear(k)\n"
        "errors = []\n"
        "for m, n, kk, g, b, t in GRID:\n"
        "    torch.set_num_threads(t)\n"
        "    x, w, s, bias = case_tensors(m, n, kk, g, b)\n"
        "    y = op.linear_int8(x, w, s, bias)\n"
        "    errors.append((y.double() - exact(x, w, s, bias)).abs().max().item())\n"
        "x, w, s, bias = case_tensors(300, 130, 576, 32, None)\n"
        "alone = torch.equal(op.linear_int8(x[-3:], w, s), op.linear_int8(x, w, s)[-3:])\n"
        "print(json.dumps({'info': k.build_info, 'errors': errors, 'alone': alone}))\n"
    )
    result = avx2_child_result(code)
    assert result["alone"]
    for (_, _, k, _, _, _), error in zip(GRID, result["errors"], strict=True):
        assert error <= tolerance(k), (k, error)
