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

from pdserve.kernels import triton_flash as flash
from pdserve.kernels.op_args import DecodeAttention, unpacks
from pdserve.kernels.triton_common import (
    LOG2_E,
    PROGRAMS_PER_SM,
    AttentionPlan,
    AttentionShape,
    check_attention_query,
    check_attention_rest,
    check_index,
    next_power_of_2,
    num_sms,
    paged_options,
    paged_strides,
    upcast_dot,
)

Tensor = torch.Tensor

# Upper bound on partitions per sequence: bounds the reduction's tile and workspace.
MAX_SPLITS = 64


@dataclass(frozen=True)
class DecodePlan(AttentionPlan):
    """How one decode launch cuts its work."""

    block_h: int  # query heads per program (the GQA group, padded for tl.dot)
    num_splits: int  # context partitions per (sequence, kv head)
    partition_size: int  # tokens per partition, a multiple of block_n


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


# Not specialized on what changes from step to step (see `triton_prefill`): the split
# plan and the width the block tables are trimmed to.
@triton.jit(do_not_specialize=["partition_size", "num_splits", "stride_ts"])
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
        scores = flash.tile_scores(q, k, scale_log2, PRECISION, UPCAST)
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        # A tile starts inside the partition, so every row sees a key: no empty rows.
        p, alpha, m_i, l_i = flash.softmax_step(scores, m_i, l_i, False)
        v = tl.load(kv_ptrs + stride_ckv, mask=kv_mask, other=0.0)
        acc = flash.accumulate_pv(acc, alpha, p, v, cache_ptr, PRECISION, UPCAST)

    # An empty partition (past the end of a short sequence) has l_i == 0: it writes
    # zeros and a log-sum-exp of -inf, which the reduction weighs at zero.
    result, safe_l = flash.normalize_rows(acc, l_i)
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


@triton.jit(do_not_specialize=["num_splits"])
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


def check_decode_inputs(op: DecodeAttention) -> tuple[AttentionShape, Tensor]:
    """What a launch checks (the fake implementation of the op checks the same): the
    sizes, and `out` (allocated if None)."""
    context_lens = op.context_lens
    shape = check_attention_query(
        op.query, op.kv_cache, "num_seqs", block_tables=op.block_tables, context_lens=context_lens
    )
    check_index("context_lens", context_lens)
    if context_lens.shape != (shape.rows,):
        raise ValueError(
            f"context_lens must be [num_seqs={shape.rows}], got {tuple(context_lens.shape)}"
        )
    return shape, check_attention_rest(op, shape.rows)


@unpacks(DecodeAttention)
def decode_attention_triton(op: DecodeAttention) -> Tensor:
    """Same contract as `reference.decode_attention_ref`.

    The split-K partition count follows `block_tables.shape[1]` (its capacity in
    tokens); callers get the best parallelism by passing tables trimmed to the
    step's longest context (and a fixed width under CUDA graphs). A sequence with
    context_len 0 (a padding row) gets zeros, where the reference gives NaN.
    """
    shape, out = check_decode_inputs(op)
    num_seqs, num_heads, head_dim, num_kv_heads, block_size, group = shape
    if num_seqs == 0:
        return out

    max_span = op.block_tables.shape[1] * block_size
    if op.sliding_window is not None:
        max_span = min(max_span, op.sliding_window)
    query = op.query
    plan = plan_decode(num_seqs, num_kv_heads, group, head_dim, max_span, num_sms(query))
    partials = DecodePartials.allocate(query, out, plan.num_splits)
    decode_attention_kernel[(num_seqs, num_kv_heads, plan.num_splits)](
        query,
        op.kv_cache,
        op.block_tables,
        op.context_lens,
        out,
        partials.out,
        partials.lse,
        op.scale * LOG2_E,
        op.sliding_window or 0,
        plan.partition_size,
        plan.num_splits,
        *paged_strides(op, out),
        NUM_HEADS=num_heads,
        BLOCK_H=plan.block_h,
        BLOCK_D=partials.block_d,
        SPLIT=partials.split,
        **paged_options(op, shape, plan, upcast_dot(query, op.kv_cache.dtype)),
    )
    if partials.split:
        _merge_partitions(partials, out, num_heads)
    return out


@dataclass(frozen=True)
class DecodePartials:
    """Split-K workspace: each partition's normalised output and log-sum-exp."""

    out: Tensor
    lse: Tensor
    num_splits: int
    block_d: int

    @property
    def split(self) -> bool:
        return self.num_splits > 1

    @classmethod
    def allocate(cls, query: Tensor, out: Tensor, num_splits: int) -> DecodePartials:
        num_seqs, num_heads, head_dim = query.shape
        block_d = next_power_of_2(head_dim)
        if num_splits == 1:  # the single-pass variant writes `out` and never reads these
            return cls(out, out, num_splits, block_d)
        rows = num_seqs * num_heads * num_splits
        out = torch.empty(rows * block_d, dtype=torch.float32, device=query.device)
        lse = torch.empty(rows, dtype=torch.float32, device=query.device)
        return cls(out, lse, num_splits, block_d)


def _merge_partitions(partials: DecodePartials, out: Tensor, num_heads: int) -> None:
    num_seqs, _, head_dim = out.shape
    merge_partitions_kernel[(num_seqs, num_heads)](
        partials.out,
        partials.lse,
        out,
        partials.num_splits,
        *out.stride(),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=partials.block_d,
        BLOCK_SPLITS=next_power_of_2(partials.num_splits),
        num_warps=4 if head_dim >= 128 else 2,
    )
