"""bfloat16 serving on CPU: bf16 values, float32 compute, on every CPU."""

import torch

from pdserve.engine.models import precision
from pdserve.kernels import linear


def test_compute_dtype_widens_bf16_on_cpu_only():
    assert precision.compute_dtype(torch.bfloat16, "cpu") == torch.float32
    assert precision.compute_dtype(torch.float32, "cpu") == torch.float32
    assert precision.compute_dtype(torch.bfloat16, "cuda") == torch.bfloat16


def test_narrow_storage_keeps_matrices_bf16_and_vectors_exact_in_float32():
    layer = torch.nn.Linear(64, 32)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    precision.store_matrices_narrow(layer, torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16
    assert torch.equal(layer.weight, weight.to(torch.bfloat16))
    assert layer.bias.dtype == torch.float32
    assert torch.equal(layer.bias, bias.to(torch.bfloat16).float())
    assert not torch.equal(layer.bias, bias)  # random fp32 values do get rounded
    # float32 activations times the bf16 matrix (kernels.linear, C or widened) agree
    # with the bf16 product before rounding.
    x = torch.randn(8, 64).to(torch.bfloat16)
    for rows in (1, 8):
        wide = linear(x[:rows].float(), layer.weight, layer.bias)
        assert wide.dtype == torch.float32
        narrow = torch.nn.functional.linear(x[:rows], layer.weight, layer.bias.bfloat16())
        torch.testing.assert_close(wide.to(torch.bfloat16), narrow, atol=2e-2, rtol=2e-2)
