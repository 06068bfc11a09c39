"""The linear layer in C (float32 and bfloat16 weights) against a float64 product of
the same values, and each row's output independent of the other rows of the call.

The grid walks row counts through every micro-kernel shape (1-4 rows and their
remainders), weight rows through partial 12-row units and tiles, and K through the
16-wide vector loop with and without a scalar tail.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import cpu_ops, dispatch
from pdserve.kernels.reference import linear_ref

BF16 = torch.bfloat16


def exact(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


def assert_close_to_exact(y: torch.Tensor, expected: torch.Tensor, k: int) -> None:
    assert y.dtype == torch.float32
    assert torch.isfinite(y).all()
    # float32 accumulation over k products of unit-scale values.
    torch.testing.assert_close(y.double(), expected, atol=1e-5 * k**0.5 + 1e-6, rtol=1e-5)


# (rows, weight rows, k, bias dtype, threads)
GRID = [
    (1, 12, 16, None, 1),
    (1, 13, 17, torch.float32, 2),  # one row past a unit; K with a 1-element tail
    (2, 6, 32, BF16, 1),
    (3, 25, 40, None, 2),  # 3-row tiles; K tail of 8
    (4, 100, 576, torch.float32, 2),
    (5, 11, 48, BF16, 1),  # 4 + 1 rows; fewer weight rows than a unit
    (7, 37, 1536, None, 2),  # 4 + 3 rows
    (13, 1, 64, torch.float32, 1),  # a single weight row
    (32, 960, 576, BF16, 2),  # SmolLM2 fused QKV at decode batch 32
    (64, 50, 5, None, 2),  # K below one vector
    (200, 70, 576, BF16, 2),  # a prefill chunk: more rows than one block of x
]


@pytest.mark.parametrize("weight_dtype", [BF16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("case", GRID, ids=lambda c: f"m{c[0]}n{c[1]}k{c[2]}-{c[3]}-t{c[4]}")
def test_linear_matches_exact_product(kernels, threads, case, weight_dtype):
    m, n, k, bias_dtype, num_threads = case
    threads(num_threads)
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen).to(weight_dtype)
    bias = None if bias_dtype is None else torch.randn(n, generator=gen).to(bias_dtype)
    y = kernels.linear(x, w, bias)
    assert y.shape == (m, n)
    assert_close_to_exact(y, exact(x, w, bias), k)


def test_strided_rows_and_leading_dims(kernels):
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(6, 200, generator=gen)
    x = wide[:, 8:72]  # rows 200 apart: read in place
    w = torch.randn(30, 64, generator=gen).to(BF16)
    assert_close_to_exact(kernels.linear(x, w), exact(x, w, None), 64)
    x3 = torch.randn(2, 3, 64, generator=gen)  # [batch, tokens, features]
    y3 = kernels.linear(x3, w)
    assert y3.shape == (2, 3, 30)
    assert_close_to_exact(y3.reshape(6, 30), exact(x3.reshape(6, 64), w, None), 64)
    xt = torch.randn(64, 5, generator=gen).t()  # columns strided: copied first
    assert_close_to_exact(kernels.linear(xt, w), exact(xt.contiguous(), w, None), 64)


@pytest.mark.parametrize("weight_dtype", [BF16, torch.float32], ids=["bf16", "f32"])
def test_a_row_does_not_depend_on_the_other_rows(kernels, threads, weight_dtype):
    """Bit for bit: one row alone, inside any batch (every tile shape, a block of rows
    past the first), at 1 or 2 threads, gives the same output (BLAS does not: it picks
    its kernel by the row count)."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(200, 1536, generator=gen).to(weight_dtype)
    bias = torch.randn(200, generator=gen)
    batch = torch.randn(300, 1536, generator=gen)
    threads(2)
    whole = kernels.linear(batch, w, bias)
    for rows in (1, 2, 3, 5, 64, 65, 300):
        for num_threads in (1, 2):
            threads(num_threads)
            part = kernels.linear(batch[-rows:], w, bias)
            assert torch.equal(part, whole[-rows:]), (rows, num_threads)


def test_other_dtypes_take_the_reference(kernels):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(40, 64, generator=gen).to(torch.float16)
    few = torch.randn(3, 64, generator=gen)
    assert torch.equal(kernels.linear(few, w), linear_ref(few, w))
    wb = torch.randn(40, 64, generator=gen).to(BF16)
    assert torch.equal(kernels.linear(few.to(BF16), wb), linear_ref(few.to(BF16), wb))
    empty = torch.empty(0, 64)
    assert kernels.linear(empty, wb).shape == (0, 40)


def test_dispatch_sends_cpu_linear_to_the_c_kernel(kernels):
    x = torch.randn(2, 64)
    w = torch.randn(8, 64).to(BF16)
    before = dispatch._cpu_enabled
    dispatch.set_cpu_kernels_enabled(True)
    try:
        chosen = dispatch.lookup("linear", x)
        assert getattr(chosen, "__name__", "") == "linear"
        assert isinstance(getattr(chosen, "__self__", None), cpu_ops.CpuKernels)
        assert_close_to_exact(chosen(x, w), exact(x, w, None), 64)
        dispatch.set_cpu_kernels_enabled(False)
        assert dispatch.lookup("linear", x) is linear_ref
    finally:
        dispatch.set_cpu_kernels_enabled(before)


def test_mismatched_shapes_get_one_line_errors(kernels):
    w = torch.randn(8, 64).to(BF16)
    with pytest.raises(ValueError, match="x has 32 features, weight expects 64"):
        kernels.linear(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match="bias must be"):
        kernels.linear(torch.randn(2, 64), w, torch.randn(7))
