"""Decode attention over the paged KV cache: one query token per sequence.

Design (memory-bound: every byte of K and V is read once per step):
- One program per (sequence, kv head, context partition). All query heads of a kv
  head are packed into one [BLOCK_H, head_dim] tile (GQA packing), so each K/V byte is
  read once for the whole group and the scores come from a tensor-core `tl.dot`.
- The context is walked in tiles of BLOCK_N tokens that span several cache blocks;
  each token's address is gathered through the block table, so any block size works
  and the block-strided per-layer view is addressed through its strides.
- Split-K: the context is cut into partitions when sequences x kv heads alone would
  not fill the device. Each partition writes its normalised partial output and its
  log-sum-exp; a reduction kernel merges them. The partition count depends only on
  tensor shapes (the block table's width), never on the values of context_lens, so a
  launch needs no device-to-host sync and can be captured in a CUDA graph.
- Scores, softmax statistics and the accumulator are fp32; exp2 with log2(e) folded
  into the scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_common import (
    PROGRAMS_PER_SM,
    check_float,
    check_heads,
    check_kv_cache,
    check_same_device,
    dot_precision,
    next_power_of_2,
    num_sms,
    upcast_dot,
)

Tensor = torch.Tensor

LOG2_E = 1.4426950408889634
# Upper bound on partitions per sequence: bounds the reduction's tile and workspace.
MAX_SPLITS = 64


@dataclass(frozen=True)
class DecodePlan:
    """How one decode launch cuts its work."""

    block_h: int  # query heads per program (the GQA group, padded for tl.dot)
    block_n: int  # tokens per inner tile
    num_splits: int  # context partitions per (sequence, kv head)
    partition_size: int  # tokens per partition, a multiple of block_n
    num_warps: int
    num_stages: int


def plan_decode(
    num_seqs: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    max_span: int,
    device_sms: int,
) -> DecodePlan:
    """Tile sizes and split-K partitioning for one launch.

    `max_span` bounds the tokens any sequence attends to (the block table's capacity,
    or the sliding window when smaller).
    """
    block_h = max(16, next_power_of_2(group))  # tl.dot needs M >= 16
    block_n = 64 if head_dim <= 128 else 32
    tiles = max(1, triton.cdiv(max_span, block_n))
    programs = max(1, num_seqs * num_kv_heads)
    wanted = triton.cdiv(PROGRAMS_PER_SM * device_sms, programs)
    splits = max(1, min(wanted, tiles, MAX_SPLITS))
    tiles_per_split = triton.cdiv(tiles, splits)
    splits = triton.cdiv(tiles, tiles_per_split)
    return DecodePlan(
        block_h=block_h,
        block_n=block_n,
        num_splits=splits,
        partition_size=tiles_per_split * block_n,
        num_warps=4,
        num_stages=3 if head_dim <= 128 else 2,
    )


@triton.jit
def decode_attention_kernel(
    query_ptr,
    cache_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    window,
    partition_size,
    num_splits,
    stride_qs,
    stride_qh,
    stride_qd,
    stride_cb,
    stride_ckv,
    stride_ch,
    stride_ct,
    stride_cd,
    stride_ts,
    stride_tb,
    stride_os,
    stride_oh,
    stride_od,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(lens_ptr + seq)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(context_len - window, 0)
    start = first + split * partition_size
    end = tl.minimum(context_len, start + partition_size)

    group_rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + group_rows
    dims = tl.arange(0, BLOCK_D)
    head_mask = group_rows < GROUP
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        query_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(cache_ptr.dtype.element_ty)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)

    table_row = tables_ptr + seq * stride_ts
    head_base = cache_ptr + kv_head * stride_ch
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        blocks = tl.load(table_row + (tokens // BLOCK_SIZE) * stride_tb, mask=token_mask, other=0)
        token_offsets = blocks.to(tl.int64) * stride_cb + (tokens % BLOCK_SIZE) * stride_ct
        kv_ptrs = head_base + token_offsets[:, None] + dims[None, :] * stride_cd
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        k = tl.load(kv_ptrs, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(kv_ptrs + stride_ckv, mask=kv_mask, other=0.0)
        # P is rounded to the cache dtype as the tensor cores take it.
        p_op = p.to(cache_ptr.dtype.element_ty)
        if UPCAST:
            v = v.to(tl.float32)
            p_op = p_op.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_op, v, input_precision=PRECISION)
        m_i = m_new

    # An empty partition (past the end of a short sequence) has l_i == 0: it writes
    # zeros and a log-sum-exp of -inf, which the reduction weighs at zero.
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    result = acc / safe_l[:, None]
    out_mask = head_mask[:, None] & dim_mask[None, :]
    if SPLIT:
        row = (seq * NUM_HEADS + heads) * num_splits + split
        tl.store(
            part_out_ptr + row[:, None] * BLOCK_D + dims[None, :],
            result,
            mask=out_mask,
        )
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=head_mask)
    else:
        tl.store(
            out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :] * stride_od,
            result.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )


@triton.jit
def merge_partitions_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    stride_os,
    stride_oh,
    stride_od,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < num_splits
    row = (seq * NUM_HEADS + head) * num_splits + splits
    lse = tl.load(part_lse_ptr + row, mask=split_mask, other=float("-inf"))
    # Every partition is empty only for context_len 0 (CUDA-graph padding rows): the
    # guards below give such a row zeros instead of NaN.
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp2(lse - top)
    partial = tl.load(
        part_out_ptr + row[:, None] * BLOCK_D + dims[None, :],
        mask=split_mask[:, None],
        other=0.0,
    )
    total = tl.sum(weights, 0)
    merged = tl.sum(partial * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + dims * stride_od,
        merged.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def decode_attention_triton(
    query: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """Same contract as `reference.decode_attention_ref`.

    The split-K partition count follows `block_tables.shape[1]` (its capacity in
    tokens); callers get the best parallelism by passing tables trimmed to the
    step's longest context (and a fixed width under CUDA graphs). A sequence with
    context_len 0 (a padding row) gets zeros, where the reference gives NaN.
    """
    if query.dim() != 3:
        raise ValueError(f"query must be [num_seqs, num_heads, head_dim], got {tuple(query.shape)}")
    num_seqs, num_heads, head_dim = query.shape
    check_float("query", query)
    check_kv_cache(kv_cache, None, head_dim)
    num_kv_heads, block_size = kv_cache.shape[2], kv_cache.shape[3]
    group = check_heads(num_heads, num_kv_heads)
    check_same_device(query=query, kv_cache=kv_cache, block_tables=block_tables)
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be [num_seqs={num_seqs}, max_blocks], "
            f"got {tuple(block_tables.shape)}"
        )
    if context_lens.shape != (num_seqs,):
        raise ValueError(
            f"context_lens must be [num_seqs={num_seqs}], got {tuple(context_lens.shape)}"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape:
        raise ValueError(f"out must have the query's shape {tuple(query.shape)}")
    if num_seqs == 0:
        return out

    max_span = block_tables.shape[1] * block_size
    if sliding_window is not None:
        max_span = min(max_span, sliding_window)
    upcast = upcast_dot(query, kv_cache.dtype)
    plan = plan_decode(num_seqs, num_kv_heads, group, head_dim, max_span, num_sms(query))
    block_d = next_power_of_2(head_dim)
    split = plan.num_splits > 1
    if split:
        part_out = torch.empty(
            num_seqs * num_heads * plan.num_splits * block_d,
            dtype=torch.float32,
            device=query.device,
        )
        part_lse = torch.empty(
            num_seqs * num_heads * plan.num_splits, dtype=torch.float32, device=query.device
        )
    else:
        part_out = part_lse = out  # unused by the single-pass variant
    decode_attention_kernel[(num_seqs, num_kv_heads, plan.num_splits)](
        query,
        kv_cache,
        block_tables,
        context_lens,
        out,
        part_out,
        part_lse,
        scale * LOG2_E,
        sliding_window or 0,
        plan.partition_size,
        plan.num_splits,
        *query.stride(),
        *kv_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=plan.block_h,
        BLOCK_N=plan.block_n,
        BLOCK_D=block_d,
        HAS_WINDOW=sliding_window is not None,
        SPLIT=split,
        PRECISION=dot_precision(kv_cache.dtype, upcast),
        UPCAST=upcast,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    if split:
        merge_partitions_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            out,
            plan.num_splits,
            *out.stride(),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_SPLITS=next_power_of_2(plan.num_splits),
            num_warps=4 if head_dim >= 128 else 2,
        )
    return out
