"""The weight-only int8 linear layer in C (kernels/cpu/linear_int8.c), bound with ctypes
like `pdserve.kernels.cpu_ops` (whose library it shares).

Same signature and meaning as `reference.linear_int8_ref`: float32 x against an int8
weight [N, K] with float32 scales [N, K / G], one per group of G inputs of a row (G = K:
one per row). The weight is read as int8 and widened in registers, never copied; each
row's output is independent of the other rows of the call, as in the float linear
layer.
"""

from __future__ import annotations

import torch

from pdserve.kernels import reference
from pdserve.kernels.cpu_ops import CpuKernels, _check, _dtype
from pdserve.kernels.shapes import int8_group_size

Tensor = torch.Tensor


class CpuInt8Linear:
    """The int8 linear layer over the loaded library: checks in Python, work in C."""

    def __init__(self, kernels: CpuKernels):
        self.kernels = kernels

    def linear_int8(
        self, x: Tensor, weight: Tensor, scales: Tensor, bias: Tensor | None = None
    ) -> Tensor:
        rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
        if x.dtype != torch.float32 or rows == 0 or not weight.is_cpu:
            return reference.linear_int8_ref(x, weight, scales, bias)
        if weight.dtype != torch.int8 or weight.dim() != 2 or weight.stride(1) != 1:
            raise ValueError(
                f"linear_int8: weight must be a 2-D int8 matrix with contiguous rows, got "
                f"{weight.dtype} {tuple(weight.shape)}"
            )
        n, k = weight.shape
        if x.shape[-1] != k:
            raise ValueError(f"linear_int8: x has {x.shape[-1]} features, weight expects {k}")
        group = int8_group_size(weight, scales)
        if not scales.is_contiguous():
            raise ValueError("linear_int8: scales must be contiguous")
        if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
            raise ValueError(
                f"linear_int8: bias must be [{n}] and contiguous, got {tuple(bias.shape)}"
            )
        x2 = x if x.dim() == 2 else x.reshape(rows, k)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        y = torch.empty(rows, n, dtype=torch.float32)
        k_ = self.kernels
        call = k_._Int8Args()
        k_._pack_int8(
            call,
            0,
            x2.data_ptr(),
            x2.stride(0),
            weight.data_ptr(),
            weight.stride(0),
            scales.data_ptr(),
            k // group,
            0 if bias is None else bias.data_ptr(),
            -1 if bias is None else _dtype("bias", bias),
            y.data_ptr(),
            n,
            rows,
            n,
            k,
            torch.get_num_threads(),
            -1,
        )
        _check(k_._int8(call), call)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)
