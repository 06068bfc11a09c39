"""Shared helpers of the Triton kernels: input checks and device facts."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import triton

from pdserve.kernels.op_args import Attention, PagedAttention
from pdserve.kernels.shapes import check_heads, check_kv_layout, check_kv_scales

Tensor = torch.Tensor

# Programs per multiprocessor the launch heuristics aim for; several resident programs
# per SM hide the latency of the gathered loads.
PROGRAMS_PER_SM = 4
# Under the interpreter (CPU tensors) a notional small device keeps the grids small
# while still sending long contexts through the split-K path.
INTERPRETER_NUM_SMS = 8

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# exp2 with log2(e) folded into the softmax scale.
LOG2_E = 1.4426950408889634


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


@functools.cache
def _cuda_num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(like: Tensor) -> int:
    """Multiprocessors of the tensor's device (a small constant for CPU tensors)."""
    if like.is_cuda:
        index = like.device.index if like.device.index is not None else 0
        return _cuda_num_sms(index)
    return INTERPRETER_NUM_SMS


def dot_precision(dtype: torch.dtype, upcast: bool) -> str:
    """fp32 operands (an fp32 cache, or upcast ones) get exact fp32 products; half
    types use their tensor-core path, where the setting has no effect."""
    return "ieee" if upcast or dtype == torch.float32 else "tf32"


def upcast_dot(like: Tensor, dtype: torch.dtype) -> bool:
    """Whether the attention kernels must feed tl.dot fp32 operands: Triton's CPU
    interpreter multiplies bfloat16 bit patterns as integers. bf16 x bf16 products
    are exact in fp32, so the upcast changes no result; CUDA launches keep the bf16
    tensor-core path."""
    return not like.is_cuda and dtype == torch.bfloat16


def check_float(name: str, tensor: Tensor) -> None:
    if tensor.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {tensor.dtype}")


def check_index(name: str, tensor: Tensor) -> None:
    if tensor.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {tensor.dtype}")


def check_same_device(**tensors: Tensor) -> None:
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        listing = ", ".join(f"{n} on {t.device}" for n, t in tensors.items())
        raise ValueError(f"tensors must share one device: {listing}")


def check_kv_cache(kv_cache: Tensor, num_kv_heads: int | None, head_dim: int) -> None:
    """The per-layer layout [num_blocks, 2, num_kv_heads, block_size, head_dim] of a
    float dtype."""
    check_kv_layout(kv_cache, num_kv_heads, head_dim)
    check_float("kv_cache", kv_cache)


class AttentionShape(NamedTuple):
    """The sizes an attention launch reads off its checked query and cache."""

    rows: int  # sequences (decode) or tokens (prefill)
    num_heads: int
    head_dim: int
    num_kv_heads: int
    block_size: int
    group: int


def check_attention_query(
    query: Tensor, kv_cache: Tensor, rows: str, **others: Tensor
) -> AttentionShape:
    """Checks query [rows, num_heads, head_dim] against the cache layout, the GQA group
    and one device for all (`others` too)."""
    if query.dim() != 3:
        raise ValueError(f"query must be [{rows}, num_heads, head_dim], got {tuple(query.shape)}")
    num_rows, num_heads, head_dim = query.shape
    check_float("query", query)
    check_kv_cache(kv_cache, None, head_dim)
    num_kv_heads, block_size = kv_cache.shape[2], kv_cache.shape[3]
    group = check_heads(num_heads, num_kv_heads)
    check_same_device(query=query, kv_cache=kv_cache, **others)
    return AttentionShape(
        rows=num_rows,
        num_heads=num_heads,
        head_dim=head_dim,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        group=group,
    )


def check_attention_rest(op: Attention, num_seqs: int) -> Tensor:
    """Checks the block tables, the window, the KV scales (1: these kernels take no FP8
    cache) and `out`; returns `out` (allocated if None)."""
    query, block_tables, out = op.query, op.block_tables, op.out
    check_index("block_tables", block_tables)
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be [num_seqs={num_seqs}, max_blocks], "
            f"got {tuple(block_tables.shape)}"
        )
    if op.sliding_window is not None and op.sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {op.sliding_window}")
    check_kv_scales(op.kv_cache, op.k_scale, op.v_scale)
    if out is None:
        return torch.empty_like(query)
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(
            f"out must be like the query ({tuple(query.shape)}, {query.dtype}, {query.device}), "
            f"got {tuple(out.shape)}, {out.dtype}, {out.device}"
        )
    return out


def paged_strides(op: PagedAttention, out: Tensor) -> tuple[int, ...]:
    """What an attention kernel addresses its tensors by, in the order of its stride
    parameters: the query's, the cache's, the block tables' and out's strides."""
    return (*op.query.stride(), *op.kv_cache.stride(), *op.block_tables.stride(), *out.stride())


@dataclass(frozen=True)
class AttentionPlan:
    """What each attention launch picks for its shapes, beyond its own row tile."""

    block_n: int  # key tokens per inner tile
    num_warps: int
    num_stages: int


def paged_options(
    op: Attention, shape: AttentionShape, plan: AttentionPlan, upcast: bool
) -> dict[str, Any]:
    """The compile-time parameters and launch options the attention kernels share."""
    return dict(
        GROUP=shape.group,
        HEAD_DIM=shape.head_dim,
        BLOCK_SIZE=shape.block_size,
        BLOCK_N=plan.block_n,
        HAS_WINDOW=op.sliding_window is not None,
        PRECISION=dot_precision(op.kv_cache.dtype, upcast),
        UPCAST=upcast,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
