"""KV-cache write: scatter this step's keys and values into their paged slots.

One program per token writes all its kv heads; a negative slot (padding) writes
nothing. Every tensor is addressed through its strides, so key/value may be views
into a fused QKV projection and the cache may be a block-strided per-layer view.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_common import (
    check_float,
    check_index,
    check_kv_cache,
    check_same_device,
    next_power_of_2,
)

Tensor = torch.Tensor


@triton.jit
def write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_ckv,
    stride_ch,
    stride_ct,
    stride_cd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    safe_slot = tl.maximum(slot, 0)
    block = safe_slot // BLOCK_SIZE
    offset = safe_slot % BLOCK_SIZE

    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    # The slot is broadcast over the tile so a padding token masks every element.
    head_mask = (heads < NUM_KV_HEADS) & (heads * 0 + slot >= 0)
    mask = head_mask[:, None] & (dims[None, :] < HEAD_DIM)

    key = tl.load(
        key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd,
        mask=mask,
    )
    value = tl.load(
        value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd,
        mask=mask,
    )
    dst = (
        cache_ptr
        + block * stride_cb
        + offset * stride_ct
        + heads[:, None] * stride_ch
        + dims[None, :] * stride_cd
    )
    dtype = cache_ptr.dtype.element_ty
    tl.store(dst, key.to(dtype), mask=mask)
    tl.store(dst + stride_ckv, value.to(dtype), mask=mask)


def check_kv_write_inputs(
    key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor
) -> None:
    """What a launch checks (the fake implementation of the op checks the same)."""
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            "key and value must both be [num_tokens, num_kv_heads, head_dim], got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    num_tokens, num_kv_heads, head_dim = key.shape
    check_float("key", key)
    check_float("value", value)
    check_kv_cache(kv_cache, num_kv_heads, head_dim)
    check_same_device(key=key, value=value, kv_cache=kv_cache, slot_mapping=slot_mapping)
    check_index("slot_mapping", slot_mapping)
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"slot_mapping must be [num_tokens={num_tokens}], got {tuple(slot_mapping.shape)}"
        )


def write_kv_cache_triton(
    key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Same contract as `reference.write_kv_cache_ref`."""
    check_kv_write_inputs(key, value, kv_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *kv_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache.shape[3],
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
