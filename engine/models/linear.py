"""Matrix multiplies of the model, with the CPU's bfloat16 weakness worked around.

torch's bfloat16 GEMM on CPUs without native bf16 instructions (no AVX512-BF16/AMX,
e.g. AVX2 machines) runs 4-5x slower than float32 once a batch has a few rows. There
the weights stay bfloat16 in memory and are widened to float32 per call, which is
exact; the product is rounded back to bfloat16 as a bf16 GEMM's output would be.
Single rows stay on the bf16 path: a matrix-vector product is memory-bound and reads
half the bytes.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
WIDEN_MIN_ROWS = 4


@functools.cache
def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return True  # unknown CPU: keep the plain path
    return "avx512_bf16" in flags or "amx_bf16" in flags


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    if (
        x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and x.shape[0] >= WIDEN_MIN_ROWS
        and not cpu_has_native_bf16()
    ):
        wide_bias = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), wide_bias).to(torch.bfloat16)
    return F.linear(x, weight, bias)
