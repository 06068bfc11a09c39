"""Neox-style rotary embedding over the full head_dim.

One program per token rotates all its query and key heads: the two halves of each
head are loaded separately, rotated in fp32 with the token's cos/sin row, and
written to fresh outputs in the input dtype (the reference returns new tensors too).
Inputs are addressed through their strides, so query/key may be views into a fused
QKV projection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_common import (
    check_float,
    check_index,
    check_same_device,
    next_power_of_2,
)

Tensor = torch.Tensor


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    token,
    cos,
    sin,
    stride_st,
    stride_sh,
    stride_sd,
    stride_dt,
    stride_dh,
    stride_dd,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HALF)
    src = src_ptr + token * stride_st + heads[:, None] * stride_sh + dims[None, :] * stride_sd
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF * stride_sd, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + token * stride_dt + heads[:, None] * stride_dh + dims[None, :] * stride_dd
    dtype = dst_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=mask)
    tl.store(dst + HALF * stride_dd, (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=mask)


@triton.jit
def rotary_embedding_kernel(
    positions_ptr,
    query_ptr,
    key_ptr,
    cache_ptr,
    query_out_ptr,
    key_out_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_qot,
    stride_qoh,
    stride_qod,
    stride_kot,
    stride_koh,
    stride_kod,
    stride_cp,
    stride_cd,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    row = cache_ptr + position * stride_cp + dims * stride_cd
    cos = tl.load(row, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF * stride_cd, mask=dims < HALF, other=0.0).to(tl.float32)
    _rotate_heads(
        query_ptr,
        query_out_ptr,
        token,
        cos,
        sin,
        stride_qt,
        stride_qh,
        stride_qd,
        stride_qot,
        stride_qoh,
        stride_qod,
        NUM_HEADS,
        HALF,
        BLOCK_H,
        BLOCK_HALF,
    )
    _rotate_heads(
        key_ptr,
        key_out_ptr,
        token,
        cos,
        sin,
        stride_kt,
        stride_kh,
        stride_kd,
        stride_kot,
        stride_koh,
        stride_kod,
        NUM_KV_HEADS,
        HALF,
        BLOCK_KV_H,
        BLOCK_HALF,
    )


def rotary_outputs(
    positions: Tensor, query: Tensor, key: Tensor, cos_sin_cache: Tensor
) -> tuple[Tensor, Tensor]:
    """Checks the inputs as a launch does and makes its outputs (the fake implementation
    of the op does the same): the rotated query and key."""
    if query.dim() != 3 or key.dim() != 3:
        raise ValueError(
            "query and key must be [num_tokens, heads, head_dim], got "
            f"{tuple(query.shape)} and {tuple(key.shape)}"
        )
    num_tokens, num_heads, head_dim = query.shape
    if key.shape[0] != num_tokens or key.shape[2] != head_dim:
        raise ValueError(f"key {tuple(key.shape)} does not match query {tuple(query.shape)}")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions must be [{num_tokens}], got {tuple(positions.shape)}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim or head_dim % 2:
        raise ValueError(
            f"cos_sin_cache must be [max_position, head_dim={head_dim}] with an even "
            f"head_dim, got {tuple(cos_sin_cache.shape)}"
        )
    check_float("query", query)
    check_float("key", key)
    check_same_device(positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache)
    check_index("positions", positions)
    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    return query_out, key_out


def rotary_embedding_triton(
    positions: Tensor, query: Tensor, key: Tensor, cos_sin_cache: Tensor
) -> tuple[Tensor, Tensor]:
    """Same contract as `reference.rotary_embedding_ref`."""
    query_out, key_out = rotary_outputs(positions, query, key, cos_sin_cache)
    num_tokens, num_heads, head_dim = query.shape
    if num_tokens == 0:
        return query_out, key_out
    half = head_dim // 2
    rotary_embedding_kernel[(num_tokens,)](
        positions,
        query,
        key,
        cos_sin_cache,
        query_out,
        key_out,
        *query.stride(),
        *key.stride(),
        *query_out.stride(),
        *key_out.stride(),
        *cos_sin_cache.stride(),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=key.shape[1],
        HALF=half,
        BLOCK_H=next_power_of_2(num_heads),
        BLOCK_KV_H=next_power_of_2(key.shape[1]),
        BLOCK_HALF=next_power_of_2(half),
        num_warps=4 if num_heads * head_dim >= 2048 else 2,
    )
    return query_out, key_out
