"""Fused element-wise ops and the linear layer used by the models, dispatched like
attention."""

from __future__ import annotations

import torch

from pdserve.kernels import dispatch

Tensor = torch.Tensor


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    return dispatch.lookup("rms_norm", x)(x, weight, eps, residual)


def rotary_embedding(
    positions: Tensor, query: Tensor, key: Tensor, cos_sin_cache: Tensor
) -> tuple[Tensor, Tensor]:
    return dispatch.lookup("rotary_embedding", query)(positions, query, key, cos_sin_cache)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T (+ bias) in x's dtype; `weight` may be stored in bfloat16 while x is
    float32 (CPUs without native bf16 GEMM), which the CPU C kernel reads as is."""
    return dispatch.lookup("linear", x)(x, weight, bias)
