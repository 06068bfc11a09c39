"""Triton prefill attention against the reference, under the interpreter.

Each batch is ragged: a single fresh token, a whole prompt ending one short of a block
boundary, a chunk continuing over a cached prefix (prefix-cache hit / chunked
prefill), a sequence with no new tokens this step, a longer chunk, and a short chunk
after a long prefix (key tiles wholly before the causal diagonal). The grid is the
same pairwise design as the decode tests; extra cases pin several query tiles per
sequence and the causal edge at the tile boundaries.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.reference import prefill_attention_ref
from pdserve.kernels.triton_prefill import (
    plan_prefill,
    prefill_attention_kernel,
    prefill_attention_triton,
)
from tests.kernels import paged
from tests.kernels.paged import assert_matches, make_paged_batch, poisoned_like, require_interpreter

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _run_case(heads, kv_heads, head_dim, block_size, dtype, window, seqs, seed):
    """seqs: (context_len, new_tokens) per sequence."""
    require_interpreter(prefill_attention_kernel)
    gen = torch.Generator().manual_seed(seed)
    lens = [ctx for ctx, _ in seqs]
    batch = make_paged_batch(lens, kv_heads, head_dim, block_size, dtype, gen)
    starts = [0]
    for _, new in seqs:
        starts.append(starts[-1] + new)
    query_start_loc = torch.tensor(starts, dtype=torch.int32)
    query = torch.randn(starts[-1], heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    out = poisoned_like(query)
    args = (query, batch.kv_cache, batch.block_tables, query_start_loc, batch.context_lens, scale)
    got = prefill_attention_triton(*args, window, out)
    assert got is out
    assert_matches(got, prefill_attention_ref(*args, window), dtype)


@pytest.mark.slow
@paged.over_attention_cases(paged.PAIRWISE)
def test_prefill_matches_reference_over_the_grid(
    heads, kv_heads, head_dim, block_size, dtype, window
):
    bs = block_size
    seqs = [(1, 1), (bs - 1, bs - 1), (bs + 1, 2), (bs, 0), (2 * bs + 3, bs + 2), (5 * bs + 3, 3)]
    _run_case(heads, kv_heads, head_dim, bs, dtype, window, seqs, seed=head_dim + bs)


@pytest.mark.slow
@pytest.mark.parametrize(
    "head_dim,dtype,window", [(64, BF16, None), (256, F16, 50)], ids=["d64-bf16", "d256-f16-w50"]
)
def test_several_query_tiles_per_sequence(head_dim, dtype, window):
    block_m = plan_prefill(head_dim, dtype).block_m
    # A prompt over two query tiles plus one token, after a cached prefix, beside a
    # chunk ending exactly on a tile boundary.
    seqs = [(block_m + 21, block_m + 1), (block_m, block_m), (3, 3)]
    _run_case(2, 1, head_dim, 16, dtype, window, seqs, seed=5)


def test_only_empty_sequences_write_nothing():
    require_interpreter(prefill_attention_kernel)
    gen = torch.Generator().manual_seed(2)
    batch = make_paged_batch([5, 9], 2, 64, 16, F32, gen)
    query = torch.empty(0, 4, 64)
    starts = torch.zeros(3, dtype=torch.int32)
    out = prefill_attention_triton(
        query, batch.kv_cache, batch.block_tables, starts, batch.context_lens, 0.125
    )
    assert out.shape == (0, 4, 64)


def test_bad_query_start_loc_gets_a_one_line_error():
    cache = torch.zeros(4, 2, 2, 16, 64)
    with pytest.raises(ValueError, match="query_start_loc"):
        prefill_attention_triton(
            torch.randn(3, 4, 64),
            cache,
            torch.zeros(2, 1, dtype=torch.int32),
            torch.tensor([0, 3], dtype=torch.int32),
            torch.tensor([3, 3], dtype=torch.int32),
            0.125,
        )
