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
from pdserve.kernels.cpu_fields import (
    as_rows,
    bias_fields,
    check_bias,
    check_features,
    row_count,
    shaped_like,
)
from pdserve.kernels.cpu_ops import CpuKernels
from pdserve.kernels.shapes import int8_group_size

Tensor = torch.Tensor


class CpuInt8Linear:
    """The int8 linear layer over the loaded library: checks in Python, work in C."""

    def __init__(self, kernels: CpuKernels):
        self.kernels = kernels

    def linear_int8(
        self, x: Tensor, weight: Tensor, scales: Tensor, bias: Tensor | None = None
    ) -> Tensor:
        rows = row_count(x)
        if x.dtype != torch.float32 or rows == 0 or not weight.is_cpu:
            return reference.linear_int8_ref(x, weight, scales, bias)
        if weight.dtype != torch.int8 or weight.dim() != 2 or weight.stride(1) != 1:
            raise ValueError(
                f"linear_int8: weight must be a 2-D int8 matrix with contiguous rows, got "
                f"{weight.dtype} {tuple(weight.shape)}"
            )
        n, k = weight.shape
        check_features("linear_int8", x, k)
        group = int8_group_size(weight, scales)
        if not scales.is_contiguous():
            raise ValueError("linear_int8: scales must be contiguous")
        check_bias("linear_int8", bias, n)
        x2 = as_rows(x, rows, k)
        y = torch.empty(rows, n, dtype=torch.float32)
        self.kernels.int8_call.run(
            *(x2.data_ptr(), x2.stride(0), weight.data_ptr(), weight.stride(0)),
            *(scales.data_ptr(), k // group),
            *bias_fields(bias),
            *(y.data_ptr(), n, rows, n, k, torch.get_num_threads()),
        )
        return shaped_like(y, x)
