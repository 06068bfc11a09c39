"""Which dtype the model computes in, given the serving dtype and the hardware.

On CPUs without native bfloat16 GEMM instructions (no AVX512-BF16/AMX, e.g. AVX2
machines), torch's bf16 matmul runs 4-5x slower than float32 once a batch has a few
rows. There a bfloat16 model computes in float32: its weight matrices stay stored in
bfloat16 (half the memory, half the bytes a decode step streams) and `kernels.linear`
multiplies float32 activations by them (a C kernel that widens in registers at decode
batch sizes, a widened copy for BLAS above); norm weights and biases hold their
bfloat16 values in float32; the KV cache stays bfloat16. Everywhere else the model
computes in the serving dtype.
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


def store_matrices_narrow(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Weight matrices (and the embedding table) stored in `dtype`; vectors (norm
    weights, biases) keep the compute dtype with exactly the values `dtype` holds."""
    for param in model.parameters():
        if param.dim() == 2:
            param.data = param.data.to(dtype)
        else:
            param.data.copy_(param.data.to(dtype))
