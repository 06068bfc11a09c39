"""Argument checks that every implementation of an op makes alike, with the same
messages: the paged-attention ops of the C kernels' bindings (`cpu_ops`, `cpu_layer_ops`)
and the Triton launches (`triton_common`), and the int8 linear layer's scale groups (its
C binding `cpu_quantized` and its reference). Torch only, so the CPU path never imports
triton."""

from __future__ import annotations

import torch


def check_kv_layout(kv_cache: torch.Tensor, num_kv_heads: int | None, head_dim: int) -> None:
    """The per-layer layout [num_blocks, 2, num_kv_heads, block_size, head_dim]."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            "kv_cache must be [num_blocks, 2, num_kv_heads, block_size, head_dim], "
            f"got shape {tuple(kv_cache.shape)}"
        )
    if num_kv_heads is not None and kv_cache.shape[2] != num_kv_heads:
        raise ValueError(f"kv_cache has {kv_cache.shape[2]} kv heads, inputs have {num_kv_heads}")
    if kv_cache.shape[4] != head_dim:
        raise ValueError(f"kv_cache head_dim {kv_cache.shape[4]} != input head_dim {head_dim}")


def check_kv_scales(kv_cache: torch.Tensor, k_scale: float, v_scale: float) -> None:
    """The per-tensor scales an FP8 cache is written and read with; a 16/32-bit cache
    has none, so a scale other than 1 there is a caller's mistake, not ignored."""
    if kv_cache.element_size() == 1:
        if not (k_scale > 0 and v_scale > 0):  # also refuses NaN
            raise ValueError(f"k_scale and v_scale must be positive, got {k_scale}, {v_scale}")
    elif k_scale != 1.0 or v_scale != 1.0:
        raise ValueError(f"k_scale/v_scale apply to an FP8 KV cache, not {kv_cache.dtype}")


def check_heads(num_heads: int, num_kv_heads: int) -> int:
    """The GQA group size; query heads must split evenly over the kv heads."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    return num_heads // num_kv_heads


# A row of several int8 scale groups: each group is whole vectors of 16 floats (AVX-512's
# width; AVX2's 8 divides it), so a vector of widened weights has one scale.
INT8_GROUP_MULTIPLE = 16


def int8_group_size(weight: torch.Tensor, scales: torch.Tensor) -> int:
    """Inputs per scale of an int8 weight [N, K] with float32 scales [N, K / G]: G."""
    n, k = weight.shape
    groups = scales.shape[-1] if scales.dim() == 2 else 0
    if scales.dtype != torch.float32 or scales.shape[0] != n or groups < 1 or k % groups:
        raise ValueError(
            f"linear_int8: scales must be float32 [{n}, K / G] for a group size G dividing "
            f"K = {k}, got {scales.dtype} {tuple(scales.shape)}"
        )
    group = k // groups
    if groups > 1 and group % INT8_GROUP_MULTIPLE:
        raise ValueError(
            f"linear_int8: a group of {group} inputs is not a multiple of "
            f"{INT8_GROUP_MULTIPLE} (nor the whole row of {k})"
        )
    return group
