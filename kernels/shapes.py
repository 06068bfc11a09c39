"""Argument checks that every implementation of the paged-attention ops makes alike, with
the same messages: the C kernels' bindings (`cpu_ops`, `cpu_layer_ops`) and the Triton
launches (`triton_common`). Torch only, so the CPU path never imports triton."""

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


def check_heads(num_heads: int, num_kv_heads: int) -> int:
    """The GQA group size; query heads must split evenly over the kv heads."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    return num_heads // num_kv_heads
