"""KV geometry shared by both sides: compatibility, TP head slices, block runs.

A rank r of a TP group of size t holds the global kv heads
[r * H / t, (r + 1) * H / t). When the prefill and decode sides run different TP
sizes, a decode rank receives from every prefill rank whose heads overlap its own.
Within one block, layer and K/V, one head's tokens are contiguous, so a head slice
is a strided view: whole-rank slices move as contiguous block runs, partial ones go
through a staging buffer (see kv_memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pdserve.common.model_split import TensorParallelError, check_tp_size
from pdserve.kvtransfer.messages import DTYPE_SIZES, KVLayout


class KVLayoutMismatch(ValueError):
    """The two sides cannot exchange KV blocks (different model geometry or TP split)."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


class KVShape(Protocol):
    """What a layout is read from: the engine's `KVCacheShape` or `KVGeometry`."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def dtype(self) -> object: ...  # a torch dtype or its name


def layout_of(shape: KVShape, tp_size: int = 1) -> KVLayout:
    """The KVLayout of an engine `KVCacheShape` or `KVGeometry` (whose kv heads are per
    rank, and whose layers a pipeline stage's: the geometry names the model's)."""
    dtype = str(shape.dtype).removeprefix("torch.")
    if dtype not in DTYPE_SIZES:
        raise KVLayoutMismatch(f"KV dtype {dtype} is not supported for transfer")
    return KVLayout(
        block_size=shape.block_size,
        num_layers=getattr(shape, "model_layers", 0) or shape.num_layers,
        num_kv_heads=shape.num_kv_heads * tp_size,
        head_dim=shape.head_dim,
        dtype=dtype,
        pipeline_parallel_size=getattr(shape, "pipeline_parallel_size", 1),
        k_scales=list(getattr(shape, "k_scales", [])),
        v_scales=list(getattr(shape, "v_scales", [])),
    )


def check_tp_split(layout: KVLayout, tp_size: int, side: str) -> None:
    """The engine's split rule (common/model_split.py) on what a layout knows."""
    try:
        check_tp_size(tp_size, None, layout.num_kv_heads)
    except TensorParallelError as exc:
        raise KVLayoutMismatch(f"{side}: {exc}") from None


def check_compatible(local: KVLayout, remote: KVLayout, remote_name: str) -> None:
    """Raise a one-line KVLayoutMismatch naming every field that differs."""
    fields = (
        "block_size",
        "num_layers",
        "num_kv_heads",
        "head_dim",
        "dtype",
        "pipeline_parallel_size",
    )
    diffs = []
    for name in fields:
        ours, theirs = getattr(local, name), getattr(remote, name)
        if ours != theirs:
            hint = " (--kv-cache-dtype must be the same on both)" if name == "dtype" else ""
            diffs.append(f"{name} {theirs} there vs {ours} here{hint}")
    for name in ("k_scales", "v_scales"):  # blocks are read with the writer's scales
        if local.dtype == remote.dtype and getattr(local, name) != getattr(remote, name):
            diffs.append(f"{name} differ (an FP8 KV cache's scales of another checkpoint)")
    if diffs:
        raise KVLayoutMismatch(f"KV layout mismatch with {remote_name}: " + "; ".join(diffs))


def head_range(layout: KVLayout, tp_rank: int, tp_size: int) -> tuple[int, int]:
    per_rank = layout.num_kv_heads // tp_size
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


@dataclass(frozen=True)
class HeadSlice:
    """Global kv heads [start, end) that one prefill rank sends to one decode rank."""

    src_rank: int
    start: int
    end: int


def source_slices(layout: KVLayout, dst_rank: int, dst_tp: int, src_tp: int) -> list[HeadSlice]:
    """The prefill ranks a decode rank receives from, and which heads from each."""
    lo, hi = head_range(layout, dst_rank, dst_tp)
    slices = []
    for src_rank in range(src_tp):
        s_lo, s_hi = head_range(layout, src_rank, src_tp)
        start, end = max(lo, s_lo), min(hi, s_hi)
        if start < end:
            slices.append(HeadSlice(src_rank, start, end))
    return slices


@dataclass(frozen=True)
class Run:
    """`count` blocks that are consecutive on both sides: one message."""

    src_start: int
    dst_start: int
    count: int


def coalesce(src_block_ids: list[int], dst_block_ids: list[int]) -> list[Run]:
    """Group position-wise block pairs into maximal runs consecutive on both sides."""
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(
            f"{len(src_block_ids)} source blocks for {len(dst_block_ids)} destination blocks"
        )
    runs: list[Run] = []
    for src, dst in zip(src_block_ids, dst_block_ids, strict=True):
        last = runs[-1] if runs else None
        if last and src == last.src_start + last.count and dst == last.dst_start + last.count:
            runs[-1] = Run(last.src_start, last.dst_start, last.count + 1)
        else:
            runs.append(Run(src, dst, 1))
    return runs
