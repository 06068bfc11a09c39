"""The linear layer on a bf16 matrix packed with its outputs in the lanes
(`kernels/lanes.py`, `kernels/cpu/linear_lanes.c`): the layout's round trip and row
lookups, the product against a float64 one of the same values (x rounded to bf16), each
row's output independent of the other rows, and its errors.

The grid walks row counts through every tile shape (1-6 rows and their remainders, row
blocks split between threads), outputs through partial groups of 64 and partial vectors
of 16, and K through odd values (a last pair half zero)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import cpu_ops, lanes
from tests.kernels.linear_checks import assert_dispatches_to, assert_rows_independent

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def dot_products(kernels):
    if not kernels.bf16_dot_available:
        pytest.skip("this build or CPU has no AVX512-BF16")
    before = kernels.bf16_dot
    kernels.bf16_dot = True
    yield
    kernels.bf16_dot = before


def exact(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.to(BF16).double() @ w.double().T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("shape", [(1, 1), (64, 2), (65, 3), (130, 577), (7, 1536)])
def test_packing_round_trips_and_rows_read_the_table(shape):
    n, k = shape
    w = torch.randn(n, k).to(BF16)
    packed = lanes.pack(w)
    assert tuple(packed.shape) == lanes.packed_shape(n, k)
    assert torch.equal(lanes.unpack(packed, n, k), w)
    ids = torch.tensor([n - 1, 0, n // 2, n - 1])
    assert torch.equal(lanes.rows(packed, ids, k), w[ids])


# (rows, outputs, k, bias dtype, threads)
GRID = [
    (1, 64, 32, None, 1),
    (1, 65, 17, torch.float32, 2),  # one output past a group; an odd K
    (2, 16, 2, BF16, 1),  # one vector of outputs; K of one pair
    (3, 200, 576, None, 2),
    (6, 960, 576, BF16, 2),  # SmolLM2's fused QKV, one full tile
    (7, 70, 1537, torch.float32, 1),  # 6 + 1 rows; an odd K past many pairs
    (11, 5, 40, None, 2),  # fewer outputs than a vector
    (4, 33, 64, torch.float16, 1),  # a float16 bias
    (32, 576, 1536, torch.float32, 2),  # a decode batch against the down projection
    (200, 130, 576, BF16, 2),  # a prefill chunk: threads split the rows
    (301, 100, 1536, None, 1),  # several blocks of rows on one thread
]


@pytest.mark.parametrize("case", GRID, ids=lambda c: f"m{c[0]}n{c[1]}k{c[2]}-{c[3]}-t{c[4]}")
def test_matches_the_exact_product(kernels, threads, case):
    m, n, k, bias_dtype, num_threads = case
    threads(num_threads)
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen).to(BF16)
    bias = None if bias_dtype is None else torch.randn(n, generator=gen).to(bias_dtype)
    y = kernels.linear_lanes(x, lanes.pack(w), n, bias)
    assert y.shape == (m, n) and y.dtype == torch.float32
    # float32 accumulation over k / 2 dot products of unit-scale values.
    torch.testing.assert_close(y.double(), exact(x, w, bias), atol=2e-5 * k**0.5, rtol=1e-5)


@pytest.mark.parametrize("k", [576, 1537])
def test_a_row_does_not_depend_on_the_other_rows(kernels, threads, k):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(200, k, generator=gen).to(BF16)
    packed, bias = lanes.pack(w), torch.randn(200, generator=gen)
    batch = torch.randn(400, k, generator=gen)
    assert_rows_independent(
        lambda rows: kernels.linear_lanes(rows, packed, 200, bias), batch, threads
    )


def test_out_rows_and_leading_dims(kernels):
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(70, 64, generator=gen).to(BF16)
    packed = lanes.pack(w)
    x = torch.randn(2, 3, 64, generator=gen)
    y = kernels.linear_lanes(x, packed, 70)
    assert y.shape == (2, 3, 70)
    buffer = torch.zeros(8, 70)
    kernels.linear_lanes(x.reshape(6, 64), packed, 70, out=buffer[:6])
    assert torch.equal(buffer[:6], y.reshape(6, 70)) and not buffer[6:].any()


def test_with_dot_products_off_it_is_the_float32_path_on_the_rows(kernels):
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(40, 96, generator=gen).to(BF16)
    x = torch.randn(5, 96, generator=gen)
    kernels.bf16_dot = False
    assert torch.equal(kernels.linear_lanes(x, lanes.pack(w), 40), kernels.linear(x, w))


def test_dispatch_and_the_reference(kernels):
    chosen = assert_dispatches_to("linear_lanes", cpu_ops.CpuKernels, lanes.linear_lanes_ref)
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(30, 64, generator=gen).to(BF16)
    x = torch.randn(4, 64, generator=gen)
    packed = lanes.pack(w)
    torch.testing.assert_close(
        chosen(x, packed, 30), lanes.linear_lanes_ref(x, packed, 30), atol=0.05, rtol=0.02
    )
    assert torch.equal(lanes.linear_lanes_ref(x, packed, 30), x @ w.float().T)


def test_bad_inputs_get_one_line_errors(kernels):
    w = lanes.pack(torch.randn(8, 64).to(BF16))
    with pytest.raises(ValueError, match="holds no"):
        kernels.linear_lanes(torch.randn(2, 64), w, 65)
    with pytest.raises(ValueError, match="holds no"):
        kernels.linear_lanes(torch.randn(2, 66), w, 8)
    with pytest.raises(ValueError, match="bias must be"):
        kernels.linear_lanes(torch.randn(2, 64), w, 8, torch.randn(7))
    with pytest.raises(ValueError, match="x must be float32"):
        kernels.linear_lanes(torch.randn(2, 64).to(BF16), w, 8)
    with pytest.raises(ValueError, match="2-D bfloat16"):
        lanes.pack(torch.randn(8, 64))
