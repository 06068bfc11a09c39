"""The attention op every model layer calls, over the paged KV cache.

Signature and layout are a contract (ARCHITECTURE.md, "Contracts"): see `pdserve.kernels.reference`
for the semantics. CPU tensors run the torch references; CUDA tensors run the Triton
kernels once they are registered in `pdserve.kernels.dispatch`.

A batch is ordered decodes first: the first `num_decode_seqs` sequences have exactly
one new token each; the rest are prefill chunks of any length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels import dispatch, reference

Tensor = torch.Tensor


@dataclass
class AttentionMetadata:
    """Where the step's tokens live in the paged cache. Built once per step, shared by
    all layers."""

    slot_mapping: Tensor  # [num_tokens] int64, -1 for padding
    block_tables: Tensor  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: Tensor  # [num_seqs + 1] int32
    context_lens: Tensor  # [num_seqs] int32: cached + new tokens per sequence
    num_decode_seqs: int  # leading sequences with a single new token each
    max_query_len: int
    max_context_len: int
    sliding_window: int | None = None

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decode_seqs


# Each op has its reference's signature and runs what `dispatch` picks for the input's device.
write_kv_cache = dispatch.dispatched(reference.write_kv_cache_ref)
decode_attention = dispatch.dispatched(reference.decode_attention_ref)
prefill_attention = dispatch.dispatched(reference.prefill_attention_ref)
# Picked by qkv's device (positions may stay where they are built).
rotary_write_kv_cache = dispatch.dispatched(reference.rotary_write_kv_cache_ref, like=1)


def kv_scale_args(kv_cache: Tensor, k_scale: float, v_scale: float) -> dict[str, float]:
    """The keyword arguments that pass a layer's KV scales to the cache ops: none for a
    16/32-bit cache (whose ops, the CUDA ones included, take no scale)."""
    if not reference.is_fp8(kv_cache):
        return {}
    return {"k_scale": k_scale, "v_scale": v_scale}


def paged_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Tensor:
    """Store this step's keys/values, then attend: [num_tokens, num_heads, head_dim]."""
    scales = kv_scale_args(kv_cache, k_scale, v_scale)
    write_kv_cache(key, value, kv_cache, meta.slot_mapping, **scales)
    return attend_cached(query, kv_cache, meta, scale, k_scale=k_scale, v_scale=v_scale)


def attend_cached(
    query: Tensor,
    kv_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Tensor:
    """Attention of the step's queries over the cache, which already holds the step's
    keys/values (`paged_attention` after its write): [num_tokens, num_heads, head_dim]."""
    out = torch.empty_like(query)
    nd = meta.num_decode_seqs
    scales = kv_scale_args(kv_cache, k_scale, v_scale)
    if nd == meta.num_seqs == query.shape[0]:  # decodes only: no views to cut
        decode_attention(
            query,
            kv_cache,
            meta.block_tables,
            meta.context_lens,
            scale,
            meta.sliding_window,
            out,
            **scales,
        )
        return out
    if nd:
        decode_attention(
            query[:nd],
            kv_cache,
            meta.block_tables[:nd],
            meta.context_lens[:nd],
            scale,
            meta.sliding_window,
            out[:nd],
            **scales,
        )
    if nd < meta.num_seqs:
        starts = meta.query_start_loc[nd:] - nd
        prefill_attention(
            query[nd:],
            kv_cache,
            meta.block_tables[nd:],
            starts,
            meta.context_lens[nd:],
            scale,
            meta.sliding_window,
            out[nd:],
            **scales,
        )
    return out
