"""bfloat16 serving on CPUs without native bf16 GEMM: bf16 values, float32 compute."""

import torch

from engine.models import precision


def test_compute_dtype_widens_bf16_only_on_cpus_without_native_bf16(monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    assert precision.compute_dtype(torch.bfloat16, "cpu") == torch.float32
    assert precision.compute_dtype(torch.float32, "cpu") == torch.float32
    assert precision.compute_dtype(torch.bfloat16, "cuda") == torch.bfloat16
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    assert precision.compute_dtype(torch.bfloat16, "cpu") == torch.bfloat16


def test_rounded_weights_hold_exactly_the_bf16_values():
    layer = torch.nn.Linear(64, 32)
    original = layer.weight.detach().clone()
    precision.round_weights_through(layer, torch.bfloat16)
    assert layer.weight.dtype == torch.float32
    assert torch.equal(layer.weight, original.to(torch.bfloat16).float())
    assert not torch.equal(layer.weight, original)  # random fp32 values do get rounded
    # A product in float32 of bf16-valued operands equals the bf16 product before rounding.
    x = torch.randn(8, 64).to(torch.bfloat16)
    wide = torch.nn.functional.linear(x.float(), layer.weight, None)
    narrow = torch.nn.functional.linear(x, layer.weight.to(torch.bfloat16), None)
    torch.testing.assert_close(wide.to(torch.bfloat16), narrow, atol=2e-2, rtol=2e-2)
