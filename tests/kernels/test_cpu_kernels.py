"""CPU C kernels against the torch references.

The grids are pairwise designs over GQA group (1, 2, 3, 4, 5, 7, 8: one or several
chunks of query heads), head_dim (64 and 128, plus 72 and 36 for the generic and
scalar-tail paths), block size 16/32, fp32/bf16/fp16 and sliding windows. Every cache
is a block-strided view of a NaN-poisoned block-major storage with shuffled block ids
and table entries past each sequence's end pointing anywhere, so a kernel that reads
a slot it should not fails; outputs start as NaN, so a row left unwritten fails too.
The AVX2 build (`PDSERVE_CPU_ISA=avx2`, in a child process) runs part of the grid and
the prefill-equals-decode check as well: its register blocks differ from AVX-512's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.kernels import cpu_build
from pdserve.kernels.reference import (
    decode_attention_ref,
    prefill_attention_ref,
    write_kv_cache_ref,
)
from tests.kernels.paged import assert_matches, make_paged_batch, poisoned_like

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (heads, kv_heads, head_dim, block_size, dtype, window)
PAIRWISE = [
    (9, 3, 64, 16, BF16, None),  # SmolLM2-135M
    (4, 4, 128, 32, F32, 7),
    (8, 2, 64, 32, F16, 40),
    (8, 1, 128, 16, BF16, 7),  # group 8: two chunks of four heads
    (6, 2, 72, 16, F32, None),  # head_dim without a specialisation
    (5, 1, 36, 32, BF16, 40),  # group 5 = 4 + 1; head_dim with a scalar tail
    (12, 4, 128, 16, F16, None),
    (2, 2, 64, 16, F32, 40),
    (14, 2, 64, 32, BF16, 20),  # group 7 = 4 + 3
    (6, 3, 36, 16, F16, 7),
]


def _case_id(case) -> str:
    heads, kv_heads, d, bs, dtype, window = case
    return f"h{heads}kv{kv_heads}-d{d}-bs{bs}-{str(dtype)[6:]}-w{window}"


def _decode_case(kernels, heads, kv_heads, head_dim, bs, dtype, window, lens, seed, **kw):
    gen = torch.Generator().manual_seed(seed)
    batch = make_paged_batch(lens, kv_heads, head_dim, bs, dtype, gen, **kw)
    query = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    args = (query, batch.kv_cache, batch.block_tables, batch.context_lens, head_dim**-0.5)
    out = poisoned_like(query)
    assert kernels.decode_attention(*args, window, out) is out
    assert_matches(out, decode_attention_ref(*args, window), dtype)
    return out


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,dtype,window", PAIRWISE, ids=map(_case_id, PAIRWISE)
)
def test_decode_matches_reference_over_the_grid(
    kernels, threads, heads, kv_heads, head_dim, block_size, dtype, window
):
    threads(1)
    bs = block_size
    lens = [bs + 1, 1, bs, bs - 1, 2 * bs + 5, 3 * bs, 70]
    _decode_case(kernels, heads, kv_heads, head_dim, bs, dtype, window, lens, seed=head_dim + bs)


@pytest.mark.parametrize("window", [None, 300], ids=["full", "window"])
def test_decode_of_a_sequence_does_not_depend_on_its_batch(kernels, threads, window):
    """Bit for bit: one long sequence alone at one or two threads, and beside 31 others
    (the output rows of a batch must not change with what else is in it)."""
    gen = torch.Generator().manual_seed(5)
    lens = [3000] + [int(n) for n in torch.randint(1, 400, (31,), generator=gen)]
    batch = make_paged_batch(lens, 2, 64, 16, BF16, gen)
    query = torch.randn(len(lens), 6, 64, generator=gen)
    tables, ctx = batch.block_tables, batch.context_lens
    threads(2)
    whole = kernels.decode_attention(query, batch.kv_cache, tables, ctx, 0.125, window)
    for num_threads in (1, 2):
        threads(num_threads)
        alone = kernels.decode_attention(
            query[:1], batch.kv_cache, tables[:1], ctx[:1], 0.125, window
        )
        assert torch.equal(alone, whole[:1]), num_threads


# (block_size, dtype, window, head_dim): tiles inside a block, blocks shorter than a
# tile, a block size that is no power of two, windows, and head_dims whose bf16 scores
# take other numbers of 16-dim steps (prefill's turned key tiles, where the CPU has
# AVX512-BF16).
INVARIANCE = [
    (16, BF16, None, 64),
    (64, F32, None, 64),
    (48, BF16, None, 64),
    (16, BF16, 37, 64),
    (32, F16, 100, 64),
    (16, BF16, None, 80),
    (32, BF16, None, 128),
]


@pytest.mark.parametrize("block_size,dtype,window,head_dim", INVARIANCE, ids=lambda c: str(c))
def test_prefill_rows_equal_decode_steps_however_chunked(
    kernels, threads, block_size, dtype, window, head_dim
):
    """Each prompt token's prefill output equals, bit for bit, a decode step at its
    position, whatever chunk it came in (one 200-token chunk, chunks of 1, 7 and 64
    over the cached prefix) and whatever else shares the call: a recomputed request
    (migrated, preempted, a prefix-cache hit) gets the same KV and logits."""
    _assert_prefill_rows_equal_decode_steps(kernels, threads, block_size, dtype, window, head_dim)


def _assert_prefill_rows_equal_decode_steps(kernels, set_threads, block_size, dtype, window, d=64):
    gen = torch.Generator().manual_seed(block_size)
    heads, kv_heads, total = 9, 3, 200
    batch = make_paged_batch([total, 90], kv_heads, d, block_size, dtype, gen)
    query = torch.randn(total, heads, d, generator=gen).to(dtype)
    cache, tables = batch.kv_cache, batch.block_tables
    steps = torch.empty_like(query)
    for p in range(total):  # one decode step per position, this sequence alone
        lens = torch.tensor([p + 1], dtype=torch.int32)
        steps[p : p + 1] = kernels.decode_attention(
            query[p : p + 1], cache, tables[:1], lens, 0.125, window
        )
    for chunk in (total, 1, 7, 64):
        for num_threads in (1, 2):
            set_threads(num_threads)
            for start in range(0, total, chunk):
                end = min(total, start + chunk)
                # The other sequence's three tokens share the call.
                q = torch.cat([query[start:end], torch.randn(3, heads, d, generator=gen).to(dtype)])
                starts = torch.tensor([0, end - start, end - start + 3], dtype=torch.int32)
                lens = torch.tensor([end, 90], dtype=torch.int32)
                out = kernels.prefill_attention(q, cache, tables, starts, lens, 0.125, window)
                assert torch.equal(out[: end - start], steps[start:end]), (chunk, start)


def check_the_avx2_build() -> None:
    """Run in a child with PDSERVE_CPU_ISA=avx2: its attention kernels (16 registers, other
    register blocks than AVX-512's) against the references, and prefill rows equal to
    decode steps there too."""
    from pdserve.kernels import cpu_ops

    kernels = cpu_ops.load()
    assert "-march=haswell" in kernels.build_info, kernels.build_info
    for heads, kv_heads, d, bs, dtype, window in PAIRWISE[:6]:
        seqs = [(1, 1), (bs + 1, 2), (2 * bs + 3, bs + 2), (300, 290)]
        _prefill_case(kernels, heads, kv_heads, d, bs, dtype, window, seqs, seed=d + bs)
        lens = [bs + 1, 1, 2 * bs + 5, 70]
        _decode_case(kernels, heads, kv_heads, d, bs, dtype, window, lens, seed=d + bs)
    _assert_prefill_rows_equal_decode_steps(kernels, torch.set_num_threads, 16, BF16, None)
    from tests.kernels.test_cpu_fp8_kv import check_fp8_kv

    check_fp8_kv(kernels)  # FP8 widens through F16C there, not AVX-512's registers
    print("avx2 attention ok")


@pytest.mark.skipif(
    not {"avx2", "fma", "f16c"} <= cpu_build.cpu_flags(), reason="the CPU has no AVX2"
)
def test_the_avx2_build_matches_the_references():
    """PDSERVE_CPU_ISA=avx2 builds per process, so the checks run in a child."""
    root = Path(__file__).resolve().parents[2]
    code = "from tests.kernels.test_cpu_kernels import check_the_avx2_build as c; c()"
    env = {**os.environ, "PDSERVE_CPU_ISA": "avx2"}
    child = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip().splitlines()[-1] == "avx2 attention ok"


EDGE_SHAPES = [
    (8, 2, 256, 64, BF16, None),  # blocks longer than a score tile; a wide head
    (4, 1, 128, 64, F32, 50),
    (6, 2, 64, 8, F16, None),
    (3, 3, 8, 1, F32, 5),  # one token per block; head_dim of one vector
    (16, 1, 64, 16, BF16, None),  # group 16: four chunks
]


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,dtype,window", EDGE_SHAPES, ids=map(_case_id, EDGE_SHAPES)
)
def test_edge_block_sizes_head_dims_and_groups(
    kernels, heads, kv_heads, head_dim, block_size, dtype, window
):
    bs = block_size
    lens = [bs + 1, 1, bs, 2 * bs + 5, 200]
    _decode_case(kernels, heads, kv_heads, head_dim, bs, dtype, window, lens, seed=17)
    seqs = [(1, 1), (bs + 1, 2), (200, 150), (bs, 0)]
    _prefill_case(kernels, heads, kv_heads, head_dim, bs, dtype, window, seqs, seed=18)


def _prefill_case(kernels, heads, kv_heads, head_dim, bs, dtype, window, seqs, seed, index=None):
    """seqs: (context_len, new_tokens) per sequence."""
    gen = torch.Generator().manual_seed(seed)
    batch = make_paged_batch([ctx for ctx, _ in seqs], kv_heads, head_dim, bs, dtype, gen)
    starts = [0]
    for _, new in seqs:
        starts.append(starts[-1] + new)
    query_start_loc = torch.tensor(starts, dtype=index or torch.int32)
    tables, lens = batch.block_tables, batch.context_lens
    if index is not None:
        tables, lens = tables.to(index), lens.to(index)
    query = torch.randn(starts[-1], heads, head_dim, generator=gen).to(dtype)
    args = (query, batch.kv_cache, tables, query_start_loc, lens, head_dim**-0.5)
    out = poisoned_like(query)
    assert kernels.prefill_attention(*args, window, out) is out
    assert_matches(out, prefill_attention_ref(*args, window), dtype)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,dtype,window", PAIRWISE, ids=map(_case_id, PAIRWISE)
)
def test_prefill_matches_reference_over_the_grid(
    kernels, heads, kv_heads, head_dim, block_size, dtype, window
):
    bs = block_size
    # A fresh token, a prompt ending one short of a block, chunks over a cached prefix,
    # a sequence with no new tokens, and a long chunk over several query tiles.
    seqs = [(1, 1), (bs - 1, bs - 1), (bs + 1, 2), (bs, 0), (2 * bs + 3, bs + 2), (5 * bs + 3, 3)]
    seqs.append((300, 290))
    _prefill_case(kernels, heads, kv_heads, head_dim, bs, dtype, window, seqs, seed=head_dim + bs)


def test_prefill_with_two_threads_and_int64_indices(kernels, threads):
    threads(2)
    seqs = [(700, 600), (40, 40), (260, 5)]
    _prefill_case(kernels, 9, 3, 64, 16, BF16, None, seqs, seed=3, index=torch.int64)
    _prefill_case(kernels, 8, 2, 128, 32, F32, 100, seqs, seed=4, index=torch.int64)


@pytest.mark.parametrize(
    "src,cache_dtype,slot_dtype",
    [
        (F32, F32, torch.int64),
        (F32, BF16, torch.int64),
        (BF16, BF16, torch.int32),
        (F16, F16, torch.int64),
    ],
    ids=["f32", "f32-to-bf16", "bf16-int32-slots", "f16"],
)
def test_write_matches_reference_bit_for_bit(kernels, threads, src, cache_dtype, slot_dtype):
    """Keys/values split out of a fused QKV row, padding slots skipped, the rest of
    the poisoned cache untouched; 300 tokens also take the multi-threaded path."""
    threads(2)
    gen = torch.Generator().manual_seed(9)
    kv_heads, d, bs, tokens = 3, 64, 16, 300
    batch = make_paged_batch([tokens], kv_heads, d, bs, cache_dtype, gen, spare_blocks=4)
    qkv = torch.randn(tokens, 9 + 2 * kv_heads, d, generator=gen).to(src)
    key, value = qkv[:, 9 : 9 + kv_heads], qkv[:, 9 + kv_heads :]
    slots = torch.randperm(batch.kv_cache.shape[0] * bs, generator=gen)[:tokens]
    slots[::7] = -1
    slots = slots.to(slot_dtype)
    want = batch.kv_cache.clone()
    write_kv_cache_ref(key, value, want, slots)
    got = batch.kv_cache
    kernels.write_kv_cache(key, value, got, slots)
    bits = torch.int32 if cache_dtype == F32 else torch.int16
    assert torch.equal(got.contiguous().view(bits), want.contiguous().view(bits))


def test_strided_query_and_output_views(kernels):
    """Query sliced out of a fused QKV tensor; output written into a wider buffer."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, d, bs = 6, 2, 64, 16
    lens = [5, 40, 17]
    batch = make_paged_batch(lens, kv_heads, d, bs, BF16, gen)
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, d, generator=gen).to(BF16)
    query = qkv[:, :heads]
    wide = torch.full((len(lens), heads, 2 * d), float("nan"), dtype=BF16)
    out = wide[:, :, d:]
    tables, lens_t = batch.block_tables.long(), batch.context_lens.long()
    kernels.decode_attention(query, batch.kv_cache, tables, lens_t, 0.1, None, out)
    assert_matches(out, decode_attention_ref(query, batch.kv_cache, tables, lens_t, 0.1), BF16)
    assert wide[:, :, :d].isnan().all(), "wrote outside the output view"

    starts = torch.tensor([0, 2, 2, 3], dtype=torch.int32)
    wide.fill_(float("nan"))
    args = (query, batch.kv_cache, tables, starts, lens_t, 0.1)
    kernels.prefill_attention(*args, None, out)
    assert_matches(out, prefill_attention_ref(*args), BF16)
    assert wide[:, :, :d].isnan().all(), "wrote outside the output view"


def test_padding_rows_with_no_context_get_zeros(kernels):
    gen = torch.Generator().manual_seed(13)
    batch = make_paged_batch([1, 1, 200], 2, 64, 16, F32, gen)
    batch.context_lens[:2] = 0
    query = torch.randn(3, 4, 64, generator=gen)
    args = (query, batch.kv_cache, batch.block_tables, batch.context_lens, 0.125)
    out = kernels.decode_attention(*args, None, poisoned_like(query))
    assert out[:2].eq(0).all()
    tables, lens = batch.block_tables[2:], batch.context_lens[2:]
    want = decode_attention_ref(query[2:], batch.kv_cache, tables, lens, 0.125)
    assert_matches(out[2:], want, F32)


def test_bad_inputs_get_one_line_errors(kernels):
    cache = torch.zeros(4, 2, 2, 16, 64)
    q = torch.randn(2, 4, 64)
    tables = torch.zeros(2, 2, dtype=torch.int32)
    lens = torch.tensor([5, 20], dtype=torch.int32)
    decode = kernels.decode_attention
    with pytest.raises(ValueError, match="block outside the KV cache"):
        decode(q, cache, torch.tensor([[0, 1], [2, 9]], dtype=torch.int32), lens, 1.0)
    with pytest.raises(ValueError, match=r"context_lens\[1\]"):
        decode(q, cache, tables, torch.tensor([5, 33], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="not a multiple"):
        decode(torch.randn(2, 3, 64), cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        decode(q[..., :32], cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        decode(q, cache, tables[:1], lens, 1.0)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        decode(q.double(), cache, tables, lens, 1.0)
    with pytest.raises(TypeError, match="int32 or int64"):
        decode(q, cache, tables.float(), lens, 1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        decode(q, cache, tables, lens, 1.0, 0)
    starts = torch.tensor([0, 3, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="query_start_loc"):
        kernels.prefill_attention(torch.randn(3, 4, 64), cache, tables, starts, lens, 1.0)
    with pytest.raises(ValueError, match="more new tokens"):
        three = torch.tensor([3, 3], dtype=torch.int32)
        kernels.prefill_attention(
            torch.randn(9, 4, 64), cache, tables, torch.tensor([0, 6, 9]), three, 1.0
        )
    with pytest.raises(ValueError, match=r"slot_mapping\[1\]"):
        kernels.write_kv_cache(q[:, :2], q[:, :2], cache, torch.tensor([3, 64]))


LOG2E = 1.4426950408889634  # the kernels' base-2 softmax multiplier


def _bf16_dot_case(kernels, seed: int, head_dim: int, lens: list[int]):
    """A bf16 cache of 2 kv heads (block 16) and a float32 query of 6 heads, scale 1/8;
    skipped where the build or CPU has no bf16 dot products."""
    if not kernels.bf16_dot_available:
        pytest.skip("this build or CPU has no AVX512-BF16")
    gen = torch.Generator().manual_seed(seed)
    batch = make_paged_batch(lens, 2, head_dim, 16, BF16, gen)
    return batch, torch.randn(len(lens), 6, head_dim, generator=gen) * 3, 0.125


def test_bf16_cache_scores_take_the_query_rounded_to_bf16(kernels):
    """Where the CPU has bf16 dot products, a bf16 cache's scores use the scaled query
    rounded to bf16 once: a float32 query then matches the reference given that rounded
    query to float32 tolerance (against the unrounded query it is ~5e-3 off). head_dim 72 takes the
    masked tail step."""
    batch, query, scale = _bf16_dot_case(kernels, 17, 72, [1, 33, 70])
    log2e = torch.tensor(LOG2E)
    rounded = (query * (torch.tensor(scale) * log2e)).to(BF16).float() / log2e
    tables, lens_t = batch.block_tables, batch.context_lens
    out = kernels.decode_attention(query, batch.kv_cache, tables, lens_t, scale)
    assert_matches(out, decode_attention_ref(rounded, batch.kv_cache, tables, lens_t, 1.0), F32)


def test_bf16_cache_values_take_the_probabilities_rounded_to_bf16(kernels):
    """Where the CPU has bf16 dot products and head_dim is a multiple of 32, P.V is bf16
    dot products too: each tile's probabilities (base 2, against the tile's running max)
    rounded to bf16 meet the cached values, and the softmax sums the float32 ones. Within
    one tile (contexts of at most a block) that is computed here in float64 from the
    rounded query; the kernel matches it to float32 tolerance, and the float32
    probabilities' output would be ~1e-3 off. Odd contexts leave the last token pair's
    second row unread (a NaN-poisoned slot)."""
    lens = [1, 9, 16]
    batch, query, scale = _bf16_dot_case(kernels, 23, 64, lens)
    heads, kv_heads, d = query.shape[1], batch.kv_cache.shape[2], query.shape[2]
    q2 = (query * torch.tensor(scale * LOG2E)).to(BF16).double()  # as begin_row rounds it
    out = kernels.decode_attention(
        query, batch.kv_cache, batch.block_tables, batch.context_lens, scale
    )
    want = torch.empty(len(lens), heads, d, dtype=torch.float64)
    unrounded = torch.empty_like(want)
    group = heads // kv_heads
    for s, n in enumerate(lens):
        block = batch.kv_cache[int(batch.block_tables[s, 0])].double()  # [2, kvh, bs, d]
        for h in range(heads):
            keys, values = block[0, h // group, :n], block[1, h // group, :n]
            scores = keys @ q2[s, h]
            p = torch.exp2(scores - scores.max())
            p16 = p.float().to(BF16).double()
            want[s, h] = (p16 @ values) / p.sum()
            unrounded[s, h] = (p @ values) / p.sum()
    assert_matches(out, want.float(), F32)
    assert (out.double() - unrounded).abs().max() > 1e-4
