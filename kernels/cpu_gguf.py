"""The GGUF block-quantized linear layer in C (kernels/cpu/linear_gguf.c), bound with
ctypes to the library `pdserve.kernels.cpu_ops` loads.

Same signature and meaning as `gguf_blocks.linear_gguf_ref`: float32 x against a weight
packed in GGUF blocks (Q8_0, Q4_0, Q4_1), read in place and decoded in registers, never
copied; each row's output is independent of the other rows of the call.
"""

from __future__ import annotations

import ctypes
import struct

import torch

from pdserve.kernels import gguf_blocks
from pdserve.kernels.cpu_build import BuildError
from pdserve.kernels.cpu_ops import CpuKernels, _check, _dtype

Tensor = torch.Tensor
# x, its row stride, packed weight, its row stride (bytes), ggml type, bias, bias dtype,
# y, its row stride, then m, n, k, threads, and the bad-input slot.
_CALL = struct.Struct("<14q")


class CpuGgufLinear:
    """The packed linear layer over the loaded library: checks in Python, work in C."""

    def __init__(self, kernels: CpuKernels):
        lib = ctypes.CDLL(str(kernels.path))  # the handle cpu_ops already opened
        lib.pd_linear_gguf_call_size.restype = ctypes.c_int64
        if lib.pd_linear_gguf_call_size() != _CALL.size:
            raise BuildError(
                f"pd_linear_gguf takes {lib.pd_linear_gguf_call_size()} bytes of arguments, "
                f"not {_CALL.size}"
            )
        self._fn = lib.pd_linear_gguf
        self._fn.argtypes = [ctypes.POINTER(ctypes.c_int64)]
        self._fn.restype = ctypes.c_int
        self._Args = ctypes.c_int64 * (_CALL.size // 8)

    def linear_gguf(
        self, x: Tensor, weight: Tensor, qtype: int, bias: Tensor | None = None
    ) -> Tensor:
        rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
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
        if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
            raise ValueError(
                f"linear_gguf: bias must be [{n}] and contiguous, got {tuple(bias.shape)}"
            )
        x2 = x if x.dim() == 2 else x.reshape(rows, k)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        y = torch.empty(rows, n, dtype=torch.float32)
        call = self._Args()
        _CALL.pack_into(
            call,
            0,
            x2.data_ptr(),
            x2.stride(0),
            weight.data_ptr(),
            weight.stride(0),
            qtype,
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
        _check(self._fn(call), call)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)
