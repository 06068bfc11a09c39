"""Which dtype the model computes in, given the serving dtype and the device.

On CPU a bfloat16 model computes in float32: its weight matrices stay stored in
bfloat16 (half the memory, half the bytes a decode step streams) and `kernels.linear`
multiplies the activations by them in C, reading the bf16 weights as they are; norm
weights and biases hold their bfloat16 values in float32; the KV cache stays bfloat16.
torch's bf16 matmul is not used: it picks its kernel by the row count, so a token's
logits would depend on what shares its step. The C kernel multiplies float32
activations with float32 FMAs, except on CPUs with AVX512-BF16, where it rounds them
to bf16 and uses bf16 dot products (2.5-3x the throughput at prefill sizes): row-
invariant on both, but the two kinds of machine compute slightly different numbers.
On CUDA (and for other dtypes) the model computes in the serving dtype.
"""

from __future__ import annotations

import torch

from pdserve.engine.models.int8 import SCALES_SUFFIX


def compute_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu":
        return torch.float32
    return dtype


def store_matrices_narrow(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Weight matrices (and the embedding table) stored in `dtype`; vectors (norm
    weights, biases) keep the compute dtype with exactly the values `dtype` holds. int8
    matrices and their float32 scales stay as they are (`int8.py`)."""
    for name, param in model.named_parameters():
        if not param.is_floating_point() or name.endswith(SCALES_SUFFIX):
            continue
        if param.dim() == 2:
            param.data = param.data.to(dtype)
        else:
            param.data.copy_(param.data.to(dtype))
