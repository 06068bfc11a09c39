"""The split-K linear kernel the GPU linear study times against cuBLAS computes
`x @ W.T + b` (Triton interpreter on CPU): one K slice and several, with a bias."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from experiments.gpu_linear import LinearConfig, linear_triton, pick_config  # noqa: E402


@pytest.mark.parametrize("rows", [1, 17])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_split_k_linear_matches_torch(rows: int, split: int, with_bias: bool) -> None:
    torch.manual_seed(rows + split)
    n, k = 70, 384
    x = torch.randn(rows, k, dtype=torch.float16)
    w = torch.randn(n, k, dtype=torch.float16) / k**0.5
    bias = torch.randn(n, dtype=torch.float16) if with_bias else None
    got = linear_triton(x, w, bias, LinearConfig(32, 64, split, 4, 2))
    want = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())
    assert got.shape == (rows, n) and got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, atol=3e-3, rtol=3e-3)


def test_the_default_configuration_splits_k_until_the_device_is_covered() -> None:
    assert pick_config(64, 4096, 14336, sms=132).split_k == 8
    assert pick_config(64, 28672, 4096, sms=132).split_k == 1
