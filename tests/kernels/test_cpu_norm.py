"""The CPU RMSNorm kernel against its torch reference, bit for bit: its sum of squares
adds in the order of torch's CPU sum, so a float32 model's outputs do not change."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.cpu_layer_ops import CpuLayerOps
from pdserve.kernels.reference import rms_norm_ref


@pytest.fixture(scope="module")
def ops(kernels) -> CpuLayerOps:
    return CpuLayerOps(kernels)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


# Row lengths: below one cascade level, the model sizes (SmolLM2 576, 960, 4096, 5120),
# tails of every kind (vectors past the 4 accumulators, scalars past the vectors), and
# rows long enough for two and three cascade levels.
LENGTHS = [8, 13, 64, 100, 576, 968, 4096, 5120, 8200, 20000]


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_matches_reference_bit_for_bit(ops, threads, n, with_residual):
    threads(2)
    gen = torch.Generator().manual_seed(n)
    rows = 3 if n > 4096 else 33
    x = torch.randn(rows, n, generator=gen) * 4
    weight = torch.randn(n, generator=gen).to(torch.bfloat16).float()  # a bf16 model's
    residual = torch.randn(rows, n, generator=gen) if with_residual else None
    want = rms_norm_ref(x, weight, 1e-5, residual)
    got = ops.rms_norm(x, weight, 1e-5, residual)
    if with_residual:
        assert torch.equal(_bits(got[0]), _bits(want[0]))
        assert torch.equal(_bits(got[1]), _bits(want[1]))
    else:
        assert torch.equal(_bits(got), _bits(want))


def test_strided_rows_leading_dims_and_one_row_alone(ops):
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(5, 700, generator=gen)
    x = wide[:, 50:626]  # rows 700 apart
    weight = torch.randn(576, generator=gen)
    assert torch.equal(_bits(ops.rms_norm(x, weight, 1e-6)), _bits(rms_norm_ref(x, weight, 1e-6)))
    heads = torch.randn(4, 3, 576, generator=gen)  # q/k norms: [tokens, heads, head_dim]
    got = ops.rms_norm(heads, weight, 1e-6)
    assert got.shape == heads.shape
    assert torch.equal(_bits(got), _bits(rms_norm_ref(heads, weight, 1e-6)))
    one = ops.rms_norm(x[2:3], weight, 1e-6)
    assert torch.equal(_bits(one), _bits(ops.rms_norm(x, weight, 1e-6)[2:3]))


def test_other_dtypes_and_short_rows_run_the_reference(ops):
    x = torch.randn(2, 4)
    weight = torch.randn(4)
    assert torch.equal(ops.rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5))
    half = torch.randn(2, 64).half()
    got = ops.rms_norm(half, torch.ones(64).half(), 1e-5)
    assert got.dtype == torch.float16
