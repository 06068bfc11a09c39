"""The weight-quantized linear layers in C, bound with ctypes to the library
`pdserve.kernels.cpu_ops` loads: int8 weights with group scales (kernels/cpu/linear_int8.c)
and GGUF blocks (kernels/cpu/linear_gguf.c, kernels/cpu/linear_kquant.c).

Both take float32 x against a weight read in place, in its stored form, and decoded in
registers, never copied; each row's output is independent of the other rows of the call,
as in the float linear layer. Other activations, no rows, or a weight off the CPU run the
references.
"""

from __future__ import annotations

import torch

from pdserve.kernels import gguf_blocks, reference
from pdserve.kernels.cpu_fields import index_code, linear_io, row_count, shaped_like
from pdserve.kernels.cpu_ops import CpuKernels
from pdserve.kernels.shapes import int8_group_size

Tensor = torch.Tensor


class CpuQuantizedLinear:
    """The quantized linear layers over the loaded library: checks in Python, work in C."""

    def __init__(self, kernels: CpuKernels):
        self.kernels = kernels

    def linear_int8(
        self,
        x: Tensor,
        weight: Tensor,
        scales: Tensor,
        bias: Tensor | None = None,
        out: Tensor | None = None,
    ) -> Tensor:
        """`reference.linear_int8_ref`: an int8 weight [N, K] with float32 scales
        [N, K / G], one per group of G inputs of a row (G = K: one per row), each weight
        widened to float32 and multiplied by its scale in registers."""
        rows = _c_rows(x, weight)
        if not rows:
            return reference.linear_int8_ref(x, weight, scales, bias)
        _check_weight_rows("linear_int8", weight, torch.int8)
        n, k = weight.shape
        x2, y, bias_ptr, bias_dt = linear_io("linear_int8", x, rows, n, k, bias, out)
        group = int8_group_size(weight, scales)
        if not scales.is_contiguous():
            raise ValueError("linear_int8: scales must be contiguous")
        self.kernels.int8_call.run(
            *(x2.data_ptr(), x2.stride(0), weight.data_ptr(), weight.stride(0)),
            *(scales.data_ptr(), k // group, bias_ptr, bias_dt),
            *(y.data_ptr(), y.stride(0), rows, n, k, torch.get_num_threads()),
        )
        return shaped_like(y, x)

    def linear_gguf(
        self,
        x: Tensor,
        weight: Tensor,
        qtype: int,
        bias: Tensor | None = None,
        weight_dtype: torch.dtype = torch.float32,
        out: Tensor | None = None,
    ) -> Tensor:
        """`gguf_blocks.linear_gguf_ref`: a weight of GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0,
        Q5_1) or K-quant super-blocks (Q4_K, Q5_K, Q6_K), each decoded to float32 weights
        in registers as ggml dequantizes it. `weight_dtype` bfloat16 with bf16 dot products
        on (`CpuKernels.bf16_dot`): a block of weight rows at a time decoded into a bf16
        panel that every row of x meets in bf16 dot products (fewer than 4 rows of
        32-weight blocks: decoded in registers), the numbers of `linear` over a bf16 copy
        of the dequantized matrix; without bf16 dot products the float32 weights, the
        exact ones. `out`: rows to write, as `linear`'s."""
        rows = _c_rows(x, weight)
        if not rows:
            return gguf_blocks.linear_gguf_ref(x, weight, qtype, bias, weight_dtype)
        if qtype not in gguf_blocks.PACKED_TYPES:
            raise ValueError(f"linear_gguf: {gguf_blocks.type_name(qtype)} is not a packed type")
        _check_weight_rows("linear_gguf", weight, torch.uint8)
        n = weight.shape[0]
        k = gguf_blocks.columns_of(qtype, weight.shape[1])
        if x.shape[-1] != k or weight.shape[1] != gguf_blocks.row_bytes(qtype, k):
            raise ValueError(
                f"linear_gguf: x has {x.shape[-1]} features, the {gguf_blocks.type_name(qtype)} "
                f"weight rows hold {weight.shape[1]} bytes"
            )
        x2, y, bias_ptr, bias_dt = linear_io("linear_gguf", x, rows, n, k, bias, out)
        self.kernels.gguf_call.run(
            *(x2.data_ptr(), x2.stride(0), weight.data_ptr(), weight.stride(0), qtype),
            *(bias_ptr, bias_dt),
            *(y.data_ptr(), y.stride(0), rows, n, k),
            *(int(self.bf16_panels(weight_dtype)), torch.get_num_threads()),
        )
        return shaped_like(y, x)

    def gguf_rows(
        self, weight: Tensor, ids: Tensor, qtype: int, weight_dtype: torch.dtype = torch.float32
    ) -> Tensor:
        """`gguf_blocks.gguf_rows_ref`: each row decoded as `linear_gguf` decodes it, on
        the calling thread (a step looks up a row per token); a weight dtype other than
        float32 or bfloat16, or ids off the CPU, run the reference."""
        if weight_dtype not in (torch.float32, torch.bfloat16) or not ids.is_cpu:
            return gguf_blocks.gguf_rows_ref(weight, ids, qtype, weight_dtype)
        if qtype not in gguf_blocks.PACKED_TYPES:
            raise ValueError(f"gguf_rows: {gguf_blocks.type_name(qtype)} is not a packed type")
        _check_weight_rows("gguf_rows", weight, torch.uint8)
        flat = ids.reshape(-1)
        k = gguf_blocks.columns_of(qtype, weight.shape[1])
        out = torch.empty(flat.shape[0], k, dtype=torch.float32)
        self.kernels.gguf_rows_call.run(
            *(weight.data_ptr(), weight.stride(0), qtype, k, weight.shape[0]),
            *(flat.data_ptr(), index_code("ids", flat), flat.stride(0), flat.shape[0]),
            *(out.data_ptr(), out.stride(0), int(weight_dtype == torch.bfloat16)),
        )
        return out.view(*ids.shape, k)

    def bf16_panels(self, weight_dtype: torch.dtype) -> bool:
        """Whether `linear_gguf` with this weight dtype takes bf16 dot products."""
        return weight_dtype == torch.bfloat16 and self.kernels.bf16_dot


def _c_rows(x: Tensor, weight: Tensor) -> int:
    """The rows of x the C kernels take: float32 x against a CPU weight; 0 (the reference
    computes) for anything else or no rows."""
    return row_count(x) if x.dtype == torch.float32 and weight.is_cpu else 0


def _check_weight_rows(op: str, weight: Tensor, dtype: torch.dtype) -> None:
    if weight.dtype != dtype or weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(
            f"{op}: weight must be a 2-D {str(dtype).removeprefix('torch.')} matrix with "
            f"contiguous rows, got {weight.dtype} {tuple(weight.shape)}"
        )
