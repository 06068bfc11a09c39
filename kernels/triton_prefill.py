"""Prefill attention over the paged KV cache: ragged causal batches.

Sequence s owns query rows query_start_loc[s]:query_start_loc[s+1], the last tokens of
its context_lens[s] tokens, whose keys/values are all in the cache already (the cached
prefix and the new tokens alike). This covers chunked prefill and prefix-cache hits.

Design (compute-bound): one program per (query tile of BLOCK_M rows of one sequence,
query head), flash-attention style over key tiles of BLOCK_N tokens gathered through
the block table. Query tiles of all sequences are numbered consecutively; a program
finds its sequence by binary search over the per-sequence tile counts, which are
computed on the device, so a launch needs no device-to-host sync. The grid is sized
by an upper bound on the tile count (tokens / BLOCK_M + sequences); spare programs
do nothing. The key loop stops at the tile's last causal position (and starts at
the sliding window's first), so masked-out tiles are never read, and key tiles wholly
before the causal diagonal skip the masking.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels import triton_flash as flash
from pdserve.kernels.op_args import PrefillAttention, unpacks
from pdserve.kernels.triton_common import (
    LOG2_E,
    AttentionPlan,
    AttentionShape,
    check_attention_query,
    check_attention_rest,
    check_index,
    next_power_of_2,
    paged_options,
    paged_strides,
    upcast_dot,
)

Tensor = torch.Tensor


@dataclass(frozen=True)
class PrefillPlan(AttentionPlan):
    block_m: int  # query rows per program


def plan_prefill(head_dim: int, dtype: torch.dtype) -> PrefillPlan:
    if dtype == torch.float32 or head_dim > 128:  # fp32 tiles take twice the registers
        return PrefillPlan(
            block_m=64, block_n=32, num_warps=4 if head_dim <= 64 else 8, num_stages=2
        )
    if head_dim <= 64:
        return PrefillPlan(block_m=128, block_n=64, num_warps=4, num_stages=3)
    return PrefillPlan(block_m=128, block_n=64, num_warps=8, num_stages=3)


# Integers that change from step to step (the batch's sequence count, the width its
# block tables are trimmed to) are not specialized on: Triton would otherwise compile a
# variant for 1, for multiples of 16 and for the rest, so a served GPU's first prompts
# of new lengths would each wait seconds for a compile.
@triton.jit(do_not_specialize=["num_seqs", "search_steps", "stride_ts"])
def prefill_attention_kernel(
    query_ptr,
    cache_ptr,
    tables_ptr,
    query_start_ptr,
    lens_ptr,
    tile_start_ptr,
    out_ptr,
    scale_log2,
    window,
    num_seqs,
    search_steps,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_cb,
    stride_ckv,
    stride_ch,
    stride_ct,
    stride_cd,
    stride_ts,
    stride_tb,
    stride_ot,
    stride_oh,
    stride_od,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP

    # The last sequence whose first tile is <= this tile (tile_start is non-decreasing).
    lo = 0
    hi = num_seqs - 1
    for _ in range(search_steps):
        mid = (lo + hi + 1) // 2
        below = tl.load(tile_start_ptr + mid) <= tile
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid - 1)
    seq = lo

    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    context_len = tl.load(lens_ptr + seq)
    first_row = (tile - tl.load(tile_start_ptr + seq)) * BLOCK_M
    prefix = context_len - q_len  # position of query row 0 is prefix

    rows = first_row + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    positions = prefix + rows
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM

    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(
        query_ptr + q_rows[:, None] * stride_qt + head * stride_qh + dims[None, :] * stride_qd,
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(cache_ptr.dtype.element_ty)
    if UPCAST:
        q = q.to(tl.float32)

    # Keys this tile can see: up to its last row's position, from the window's start.
    kv_end = prefix + tl.minimum(first_row + BLOCK_M, q_len)
    kv_end = tl.where(first_row < q_len, kv_end, 0)  # spare program: no work
    kv_start = 0
    if HAS_WINDOW:
        kv_start = tl.maximum(prefix + first_row - window + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    table_row = tables_ptr + tl.cast(seq, tl.int64) * stride_ts
    head_base = cache_ptr + kv_head * stride_ch
    # Keys before the tile's first row's position are visible to every row, so without
    # a window the tiles wholly before it (phase 0) need no masking at all; the tiles
    # on the causal diagonal (phase 1) are masked per element.
    diagonal = kv_start
    if not HAS_WINDOW:
        diagonal = tl.minimum((prefix + first_row + 1) // BLOCK_N * BLOCK_N, kv_end)
    for phase in tl.static_range(2):
        if phase == 0:
            lo_token = kv_start
            hi_token = diagonal
        else:
            lo_token = diagonal
            hi_token = kv_end
        for tile_start in range(lo_token, hi_token, BLOCK_N):
            tokens = tile_start + tl.arange(0, BLOCK_N)
            token_mask = tokens < kv_end
            if phase == 0:
                blocks = tl.load(table_row + (tokens // BLOCK_SIZE) * stride_tb)
                kv_mask = (tokens >= 0)[:, None] & dim_mask[None, :]
            else:
                blocks = tl.load(
                    table_row + (tokens // BLOCK_SIZE) * stride_tb, mask=token_mask, other=0
                )
                kv_mask = token_mask[:, None] & dim_mask[None, :]
            token_offsets = blocks.to(tl.int64) * stride_cb + (tokens % BLOCK_SIZE) * stride_ct
            kv_ptrs = head_base + token_offsets[:, None] + dims[None, :] * stride_cd
            if phase == 0 and HEAD_DIM == BLOCK_D:
                k = tl.load(kv_ptrs)
            else:
                k = tl.load(kv_ptrs, mask=kv_mask, other=0.0)
            scores = flash.tile_scores(q, k, scale_log2, PRECISION, UPCAST)
            if phase == 1:
                visible = token_mask[None, :] & (tokens[None, :] <= positions[:, None])
                if HAS_WINDOW:
                    visible = visible & (tokens[None, :] > positions[:, None] - window)
                scores = tl.where(visible, scores, float("-inf"))
            # Rows may have seen no key yet (window start, spare rows).
            p, alpha, m_i, l_i = flash.softmax_step(scores, m_i, l_i, True)
            if phase == 0 and HEAD_DIM == BLOCK_D:
                v = tl.load(kv_ptrs + stride_ckv)
            else:
                v = tl.load(kv_ptrs + stride_ckv, mask=kv_mask, other=0.0)
            acc = flash.accumulate_pv(acc, alpha, p, v, cache_ptr, PRECISION, UPCAST)

    result, _ = flash.normalize_rows(acc, l_i)
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + dims[None, :] * stride_od,
        result.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


def check_prefill_inputs(op: PrefillAttention) -> tuple[AttentionShape, Tensor]:
    """What a launch checks (the fake implementation of the op checks the same): the
    sizes, and `out` (allocated if None)."""
    starts, context_lens = op.query_start_loc, op.context_lens
    shape = check_attention_query(
        op.query,
        op.kv_cache,
        "num_tokens",
        block_tables=op.block_tables,
        query_start_loc=starts,
        context_lens=context_lens,
    )
    check_index("query_start_loc", starts)
    check_index("context_lens", context_lens)
    num_seqs = context_lens.shape[0]
    if context_lens.dim() != 1 or starts.shape != (num_seqs + 1,):
        raise ValueError(
            f"query_start_loc must be [num_seqs + 1 = {num_seqs + 1}] for context_lens "
            f"[num_seqs], got {tuple(starts.shape)} and {tuple(context_lens.shape)}"
        )
    return shape, check_attention_rest(op, num_seqs)


@unpacks(PrefillAttention)
def prefill_attention_triton(op: PrefillAttention) -> Tensor:
    """Same contract as `reference.prefill_attention_ref`."""
    shape, out = check_prefill_inputs(op)
    num_tokens, num_heads, head_dim, _, _, _ = shape
    num_seqs = op.context_lens.shape[0]
    if num_seqs == 0 or num_tokens == 0:
        return out

    query, starts = op.query, op.query_start_loc
    plan = plan_prefill(head_dim, query.dtype)
    q_lens = (starts[1:] - starts[:-1]).to(torch.int32)
    tiles = torch.div(q_lens + plan.block_m - 1, plan.block_m, rounding_mode="floor")
    tile_start = torch.zeros(num_seqs + 1, dtype=torch.int32, device=query.device)
    torch.cumsum(tiles, 0, dtype=torch.int32, out=tile_start[1:])
    # Every sequence adds at most one partial tile to tokens / BLOCK_M.
    max_tiles = num_tokens // plan.block_m + num_seqs
    prefill_attention_kernel[(max_tiles, num_heads)](
        query,
        op.kv_cache,
        op.block_tables,
        starts,
        op.context_lens,
        tile_start,
        out,
        op.scale * LOG2_E,
        op.sliding_window or 0,
        num_seqs,
        max(1, num_seqs - 1).bit_length(),
        *paged_strides(op, out),
        BLOCK_M=plan.block_m,
        BLOCK_D=next_power_of_2(head_dim),
        **paged_options(op, shape, plan, upcast_dot(query, op.kv_cache.dtype)),
    )
    return out
