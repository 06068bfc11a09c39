"""The CPU silu-and-multiply kernel against its torch reference and against float64:
within a few ulps of the exact value everywhere (as torch's own silu is), each row's
output its own."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.cpu_layer_ops import CpuLayerOps
from pdserve.kernels.reference import silu_and_mul_ref


@pytest.fixture(scope="module")
def ops(kernels) -> CpuLayerOps:
    return CpuLayerOps(kernels)


def ulps_from_exact(got: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    exact = gate.double() * torch.sigmoid(gate.double()) * up.double()
    spacing = torch.nextafter(exact.float().abs(), torch.tensor(float("inf"))).double()
    spacing = spacing - exact.float().abs().double()
    return ((got.double() - exact).abs() / spacing).nan_to_num()


@pytest.mark.parametrize("width", [1536, 13, 8, 1])  # the model's, tails, a single column
def test_within_a_few_ulps_of_the_exact_value(ops, threads, width):
    threads(2)
    gen = torch.Generator().manual_seed(width)
    # The gate across silu's whole range (the exponent's reduction matters at |x| > 20).
    gate = torch.linspace(-80, 80, 24 * width).view(24, width)
    gate = gate[torch.randperm(24, generator=gen)]
    up = torch.randn(24, width, generator=gen)
    got = ops.silu_and_mul(torch.cat((gate, up), dim=1))
    assert got.shape == (24, width)
    assert ulps_from_exact(got, gate, up).max() <= 4
    want = silu_and_mul_ref(torch.cat((gate, up), dim=1))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30)


def test_edges_rows_alone_and_leading_dims(ops):
    edges = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -87.0, float("inf"), float("-inf")])
    got = ops.silu_and_mul(torch.cat((edges, torch.ones(8))).view(1, 16))[0]
    assert torch.equal(got[:4], edges[:4] / 2)
    assert got[4] == 88.0 and abs(got[5]) < 1e-35
    assert got[6] == float("inf") and got[7].isnan()  # -inf * sigmoid(-inf), as torch
    x = torch.randn(5, 3, 2 * 100)
    full = ops.silu_and_mul(x)
    assert full.shape == (5, 3, 100)
    assert torch.equal(ops.silu_and_mul(x[2, 1:2]), full[2, 1:2])


def test_other_dtypes_and_odd_widths_run_the_reference(ops):
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(ops.silu_and_mul(x), silu_and_mul_ref(x))
    odd = torch.randn(2, 7)
    with pytest.raises(RuntimeError):  # the reference's own error: halves do not split
        ops.silu_and_mul(odd)
