"""The linear layer in C (float32 and bfloat16 weights; bf16 weights also on bf16 dot
products with x rounded to bf16, where the CPU has AVX512-BF16) against a float64
product of the same values, and each row's output independent of the other rows of
the call.

The grid walks row counts through every micro-kernel shape (1-4 rows and their
remainders), weight rows through partial units, tiles and weight blocks (12 and 24 rows
for the two paths), and K through the vector loops with and without a tail (down to one
bf16 pair, and odd K past several 32-wide steps).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pdserve.kernels import cpu_ops
from pdserve.kernels.reference import linear_ref
from tests.kernels.linear_checks import (
    assert_dispatches_to,
    assert_rows_independent,
    cpu_has,
    run_avx2_child,
)

BF16 = torch.bfloat16
# The arithmetic paths: float32 weights; bf16 weights against float32 x; bf16 weights
# against x rounded to bf16 (bf16 dot products).
PATHS = [("f32", torch.float32, False), ("bf16", BF16, False), ("bf16-dot", BF16, True)]


@pytest.fixture(params=PATHS, ids=[p[0] for p in PATHS])
def path(request, kernels) -> Iterator[tuple[torch.dtype, bool]]:
    """(weight dtype, bf16 dot products) with the kernels set to that path."""
    _, dtype, dot = request.param
    if dot and not kernels.bf16_dot_available:
        pytest.skip("this build or CPU has no AVX512-BF16")
    before = kernels.bf16_dot
    kernels.bf16_dot = dot
    yield dtype, dot
    kernels.bf16_dot = before


def exact(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


def assert_close_to_exact(y: torch.Tensor, expected: torch.Tensor, k: int) -> None:
    assert y.dtype == torch.float32
    assert torch.isfinite(y).all()
    # float32 accumulation over k products of unit-scale values.
    torch.testing.assert_close(y.double(), expected, atol=1e-5 * k**0.5 + 1e-6, rtol=1e-5)


def as_computed(x: torch.Tensor, dot: bool) -> torch.Tensor:
    """x as the kernel multiplies it: rounded to bf16 on the dot-product path."""
    return x.to(BF16).float() if dot else x


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
    (6, 16, 32, torch.float16, 1),  # a float16 bias; 4 + 2 rows
    (11, 129, 2, torch.float32, 2),  # K of one pair; weight rows one past a 128-row block
    (19, 530, 576, BF16, 2),  # 4 x 4 + 3 rows; weight rows over several L2 blocks
    (9, 70, 1537, None, 1),  # 2 x 4 + 1 rows; an odd K past 48 vector steps
]


@pytest.mark.parametrize("case", GRID, ids=lambda c: f"m{c[0]}n{c[1]}k{c[2]}-{c[3]}-t{c[4]}")
def test_linear_matches_exact_product(kernels, threads, case, path):
    m, n, k, bias_dtype, num_threads = case
    weight_dtype, dot = path
    threads(num_threads)
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen).to(weight_dtype)
    bias = None if bias_dtype is None else torch.randn(n, generator=gen).to(bias_dtype)
    y = kernels.linear(x, w, bias)
    assert y.shape == (m, n)
    assert_close_to_exact(y, exact(as_computed(x, dot), w, bias), k)


def test_strided_rows_and_leading_dims(kernels):
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(6, 200, generator=gen)
    x = wide[:, 8:72]  # rows 200 apart: read in place
    w = torch.randn(30, 64, generator=gen).to(BF16)
    dot = kernels.bf16_dot
    assert_close_to_exact(kernels.linear(x, w), exact(as_computed(x, dot), w, None), 64)
    x3 = torch.randn(2, 3, 64, generator=gen)  # [batch, tokens, features]
    y3 = kernels.linear(x3, w)
    assert y3.shape == (2, 3, 30)
    expected = exact(as_computed(x3.reshape(6, 64), dot), w, None)
    assert_close_to_exact(y3.reshape(6, 30), expected, 64)
    xt = torch.randn(64, 5, generator=gen).t()  # columns strided: copied first
    expected = exact(as_computed(xt.contiguous(), dot), w, None)
    assert_close_to_exact(kernels.linear(xt, w), expected, 64)


@pytest.mark.parametrize("k", [1536, 1000], ids=["k1536", "k1000"])  # 1000: a K tail
def test_a_row_does_not_depend_on_the_other_rows(kernels, threads, path, k):
    """Bit for bit: one row alone, inside any batch (every tile shape, a block of rows
    past the first), at 1 or 2 threads, gives the same output (BLAS does not: it picks
    its kernel by the row count)."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(200, k, generator=gen).to(path[0])
    bias = torch.randn(200, generator=gen)
    batch = torch.randn(300, k, generator=gen)
    assert_rows_independent(lambda rows: kernels.linear(rows, w, bias), batch, threads)


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
    chosen = assert_dispatches_to("linear", cpu_ops.CpuKernels, linear_ref)
    assert getattr(chosen, "__name__", "") == "linear"
    x = torch.randn(2, 64)
    w = torch.randn(8, 64).to(BF16)
    expected = exact(as_computed(x, kernels.bf16_dot), w, None)
    assert_close_to_exact(chosen(x, w), expected, 64)


def test_mismatched_shapes_get_one_line_errors(kernels):
    w = torch.randn(8, 64).to(BF16)
    with pytest.raises(ValueError, match="x has 32 features, weight expects 64"):
        kernels.linear(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match="bias must be"):
        kernels.linear(torch.randn(2, 64), w, torch.randn(7))


def test_bf16_dot_products_where_the_build_and_cpu_have_them(kernels):
    """The native build on a CPU with AVX512-BF16 takes the dot-product path by default."""
    native = "-march=native" in kernels.build_info
    assert kernels.bf16_dot_available == (native and cpu_has("avx512_bf16"))
    assert kernels.bf16_dot == kernels.bf16_dot_available
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(3, 96, generator=gen), torch.randn(20, 96, generator=gen).to(BF16)
    assert_close_to_exact(
        kernels.linear(x, w), exact(as_computed(x, kernels.bf16_dot), w, None), 96
    )


@pytest.mark.skipif(not cpu_has("avx512_bf16"), reason="the CPU has no AVX512-BF16")
def test_the_avx2_build_keeps_float32_activations():
    """PDSERVE_CPU_ISA=avx2 (a child process: the build is per process) computes bf16
    weights against float32 x, as every AVX2 machine does, and asking that build for
    bf16 dot products is an error, not other numbers."""
    code = (
        "import torch; from pdserve.kernels import cpu_ops; k = cpu_ops.load(); "
        "g = torch.Generator().manual_seed(5); x = torch.randn(4, 64, generator=g); "
        "w = torch.randn(8, 64, generator=g).bfloat16(); "
        "err = (k.linear(x, w).double() - x.double() @ w.double().T).abs().max().item(); "
        "print(k.bf16_dot_available, k.bf16_dot, err < 1e-4)\n"
        "k.bf16_dot = True\n"
        "try: k.linear(x, w)\n"
        "except ValueError as e: print(e)"
    )
    lines = run_avx2_child(code)
    assert lines[-2].split() == ["False", "False", "True"]
    assert "no bf16 dot-product linear layer" in lines[-1]
