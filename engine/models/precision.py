"""Which dtype the model computes in, given the serving dtype and the hardware.

On CPUs without native bfloat16 GEMM instructions (no AVX512-BF16/AMX, e.g. AVX2
machines), torch's bf16 matmul runs 4-5x slower than float32 once a batch has a few
rows, and widening bf16 weights per call costs a full pass over them every step.
There a bfloat16 model keeps its weights rounded to bfloat16 values but stored and
multiplied in float32; its KV cache stays bfloat16. Everywhere else the model computes
in the serving dtype.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return True  # unknown CPU: keep the plain path
    return "avx512_bf16" in flags or "amx_bf16" in flags


def compute_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not cpu_has_native_bf16():
        return torch.float32
    return dtype


def round_weights_through(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Give every parameter exactly the values it would have in `dtype`."""
    for param in model.parameters():
        param.data.copy_(param.data.to(dtype))
