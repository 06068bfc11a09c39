"""Fused element-wise ops used by the models, dispatched like attention."""

from __future__ import annotations

import torch

from kernels import dispatch

Tensor = torch.Tensor


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    return dispatch.lookup("rms_norm", x)(x, weight, eps, residual)


def rotary_embedding(
    positions: Tensor, query: Tensor, key: Tensor, cos_sin_cache: Tensor
) -> tuple[Tensor, Tensor]:
    return dispatch.lookup("rotary_embedding", query)(positions, query, key, cos_sin_cache)
