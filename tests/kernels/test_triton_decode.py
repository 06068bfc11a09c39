"""Triton decode attention against the reference, under the interpreter.

The grid covers every value of each axis (GQA group 1/2/3/4 incl. MQA, head_dim
64/128/256, block size 16/32, fp32/fp16/bf16, with and without a sliding window) in a
pairwise design, every batch holding the ragged lengths 1, bs-1, bs, bs+1; separate
cases pin the split-K path (long contexts, partitions past a short sequence's end)
and the single-pass path.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.reference import decode_attention_ref
from pdserve.kernels.triton_common import INTERPRETER_NUM_SMS
from pdserve.kernels.triton_decode import (
    decode_attention_kernel,
    decode_attention_triton,
    plan_decode,
)
from tests.kernels import paged
from tests.kernels.paged import assert_matches, make_paged_batch, poisoned_like, require_interpreter

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _run_case(heads, kv_heads, head_dim, block_size, dtype, window, lens, seed, **batch_kw):
    require_interpreter(decode_attention_kernel)
    gen = torch.Generator().manual_seed(seed)
    batch = make_paged_batch(lens, kv_heads, head_dim, block_size, dtype, gen, **batch_kw)
    query = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    out = poisoned_like(query)
    got = decode_attention_triton(
        query, batch.kv_cache, batch.block_tables, batch.context_lens, scale, window, out
    )
    assert got is out
    want = decode_attention_ref(
        query, batch.kv_cache, batch.block_tables, batch.context_lens, scale, window
    )
    assert_matches(got, want, dtype)
    return batch


@paged.over_attention_cases(paged.PAIRWISE)
def test_decode_matches_reference_over_the_grid(
    heads, kv_heads, head_dim, block_size, dtype, window
):
    bs = block_size
    lens = [bs + 1, 1, bs, bs - 1, 2 * bs + 5]
    _run_case(heads, kv_heads, head_dim, bs, dtype, window, lens, seed=head_dim + bs)


def _split_plan(num_seqs, kv_heads, heads, head_dim, span):
    return plan_decode(num_seqs, kv_heads, heads // kv_heads, head_dim, span, INTERPRETER_NUM_SMS)


SPLIT_CASES = [
    (8, 2, 128, 16, BF16, None),  # the 8B model's 4:1 grouping
    (6, 2, 64, 32, F16, 100),
    (4, 1, 256, 16, F32, None),
]


@paged.over_attention_cases(SPLIT_CASES)
def test_long_contexts_take_the_split_k_path(heads, kv_heads, head_dim, block_size, dtype, window):
    # Lengths at partition boundaries, one sequence shorter than a partition (its later
    # partitions are empty) and one filling the whole table.
    width = -(-600 // block_size)
    span = width * block_size if window is None else min(width * block_size, window)
    plan = _split_plan(4, kv_heads, heads, head_dim, span)
    assert plan.num_splits > 1
    part = plan.partition_size
    lens = [1, part, part + 1, width * block_size]
    _run_case(heads, kv_heads, head_dim, block_size, dtype, window, lens, seed=7, extra_width=0)


def test_many_sequences_take_the_single_pass_path():
    heads, kv_heads, head_dim, block_size = 8, 4, 64, 16
    lens = [1 + 13 * i for i in range(8)]
    width = -(-max(lens) // block_size) + 1
    plan = _split_plan(len(lens), kv_heads, heads, head_dim, width * block_size)
    assert plan.num_splits == 1
    _run_case(heads, kv_heads, head_dim, block_size, F16, None, lens, seed=3)


def test_strided_query_and_output_views():
    """Query sliced out of a fused QKV tensor; output written into a wider buffer."""
    require_interpreter(decode_attention_kernel)
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, d, bs = 4, 2, 64, 16
    lens = [5, 40, 17]
    batch = make_paged_batch(lens, kv_heads, d, bs, F32, gen)
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, d, generator=gen)
    query = qkv[:, :heads]
    wide = torch.full((len(lens), heads, 2 * d), float("nan"))
    out = wide[:, :, d:]
    decode_attention_triton(
        query, batch.kv_cache, batch.block_tables, batch.context_lens, 0.1, None, out
    )
    want = decode_attention_ref(query, batch.kv_cache, batch.block_tables, batch.context_lens, 0.1)
    assert_matches(out, want, F32)
    assert wide[:, :, :d].isnan().all(), "wrote outside the output view"


def test_plan_bounds_partitions_and_covers_the_span():
    for seqs, span in [(1, 16), (1, 16384), (32, 4096), (128, 1024), (3, 100_000)]:
        plan = plan_decode(seqs, 8, 4, 128, span, device_sms=132)
        assert 1 <= plan.num_splits <= 64
        assert plan.partition_size % plan.block_n == 0
        assert plan.num_splits * plan.partition_size >= span
        assert (plan.num_splits - 1) * plan.partition_size < span
    # Enough sequences fill the device without splitting.
    assert plan_decode(128, 8, 4, 128, 16384, device_sms=132).num_splits == 1


def test_bad_shapes_get_one_line_errors():
    q = torch.randn(2, 6, 64)
    cache = torch.zeros(4, 2, 4, 16, 64)
    tables = torch.zeros(2, 1, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="not a multiple"):
        decode_attention_triton(q, cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        decode_attention_triton(q[:, :4], cache, tables[:1], lens, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        decode_attention_triton(q[:, :4, :32], cache, tables, lens, 1.0)
    with pytest.raises(TypeError, match="float16"):
        decode_attention_triton(q[:, :4].double(), cache, tables, lens, 1.0)


@pytest.mark.parametrize("seqs", [2, 16], ids=["split-k", "single-pass"])
def test_padding_rows_with_no_context_get_zeros(seqs):
    """CUDA-graph batches are padded with context_len 0 rows: zeros, never NaN."""
    require_interpreter(decode_attention_kernel)
    gen = torch.Generator().manual_seed(13)
    lens = [0] * (seqs - 1) + [200]
    batch = make_paged_batch([max(n, 1) for n in lens], 2, 64, 16, F32, gen)
    batch.context_lens[:-1] = 0
    plan = _split_plan(seqs, 2, 4, 64, batch.block_tables.shape[1] * 16)
    assert (plan.num_splits > 1) == (seqs == 2)
    query = torch.randn(seqs, 4, 64, generator=gen)
    args = (query, batch.kv_cache, batch.block_tables, batch.context_lens, 0.125)
    out = decode_attention_triton(*args, None, poisoned_like(query))
    assert out[:-1].eq(0).all()
    want = decode_attention_ref(
        query[-1:], batch.kv_cache, batch.block_tables[-1:], batch.context_lens[-1:], 0.125
    )
    assert_matches(out[-1:], want, F32)
