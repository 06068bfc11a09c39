"""The GGUF block-quantized linear layer in C (kernels/cpu/linear_gguf.c), bound with
ctypes to the library `pdserve.kernels.cpu_ops` loads.

Same signature and meaning as `gguf_blocks.linear_gguf_ref`: float32 x against a weight
packed in GGUF blocks (Q8_0, Q4_0, Q4_1), read in place and decoded in registers, never
copied; each row's output is independent of the other rows of the call.
"""

from __future__ import annotations

import torch

from pdserve.kernels import gguf_blocks
from pdserve.kernels.cpu_fields import as_rows, bias_fields, check_bias, row_count, shaped_like
from pdserve.kernels.cpu_ops import CpuKernels

Tensor = torch.Tensor


class CpuGgufLinear:
    """The packed linear layer over the loaded library: checks in Python, work in C."""

    def __init__(self, kernels: CpuKernels):
        self.kernels = kernels

    def linear_gguf(
        self, x: Tensor, weight: Tensor, qtype: int, bias: Tensor | None = None
    ) -> Tensor:
        rows = row_count(x)
        if x.dtype != torch.float32 or rows == 0 or not weight.is_cpu:
            return gguf_blocks.linear_gguf_ref(x, weight, qtype, bias)
        if qtype not in gguf_blocks.PACKED_TYPES:
            raise ValueError(f"linear_gguf: {gguf_blocks.type_name(qtype)} is not a packed type")
        if weight.dtype != torch.uint8 or weight.dim() != 2 or weight.stride(1) != 1:
            raise ValueError(
                f"linear_gguf: weight must be a 2-D uint8 matrix with contiguous rows, got "
                f"{weight.dtype} {tuple(weight.shape)}"
            )
        n = weight.shape[0]
        k = gguf_blocks.columns_of(qtype, weight.shape[1])
        if x.shape[-1] != k or weight.shape[1] != gguf_blocks.row_bytes(qtype, k):
            raise ValueError(
                f"linear_gguf: x has {x.shape[-1]} features, the {gguf_blocks.type_name(qtype)} "
                f"weight rows hold {weight.shape[1]} bytes"
            )
        check_bias("linear_gguf", bias, n)
        x2 = as_rows(x, rows, k)
        y = torch.empty(rows, n, dtype=torch.float32)
        self.kernels.gguf_call.run(
            *(x2.data_ptr(), x2.stride(0), weight.data_ptr(), weight.stride(0), qtype),
            *bias_fields(bias),
            *(y.data_ptr(), n, rows, n, k, torch.get_num_threads()),
        )
        return shaped_like(y, x)
