"""The attention op every model layer calls, over the paged KV cache.

Signature and layout are a contract (DESIGN.md, "Contracts"): see `pdserve.kernels.reference`
for the semantics. CPU tensors run the torch references; CUDA tensors run the Triton
kernels once they are registered in `pdserve.kernels.dispatch`.

A batch is ordered decodes first: the first `num_decode_seqs` sequences have exactly
one new token each; the rest are prefill chunks of any length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels import dispatch

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


def write_kv_cache(key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    dispatch.lookup("write_kv_cache", key)(key, value, kv_cache, slot_mapping)


def decode_attention(
    query: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: Tensor | None = None,
) -> Tensor:
    fn = dispatch.lookup("decode_attention", query)
    return fn(query, kv_cache, block_tables, context_lens, scale, sliding_window, out)


def prefill_attention(
    query: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    context_lens: Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: Tensor | None = None,
) -> Tensor:
    fn = dispatch.lookup("prefill_attention", query)
    return fn(
        query, kv_cache, block_tables, query_start_loc, context_lens, scale, sliding_window, out
    )


def paged_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> Tensor:
    """Store this step's keys/values, then attend: [num_tokens, num_heads, head_dim]."""
    write_kv_cache(key, value, kv_cache, meta.slot_mapping)
    out = torch.empty_like(query)
    nd = meta.num_decode_seqs
    if nd:
        decode_attention(
            query[:nd],
            kv_cache,
            meta.block_tables[:nd],
            meta.context_lens[:nd],
            scale,
            meta.sliding_window,
            out[:nd],
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
        )
    return out
