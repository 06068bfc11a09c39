"""The torch references against dense attention computed without any paging."""

import pytest
import torch

from pdserve.kernels import AttentionMetadata, paged_attention
from pdserve.kernels.reference import (
    decode_attention_ref,
    prefill_attention_ref,
    rms_norm_ref,
    rotary_embedding_ref,
    write_kv_cache_ref,
)


def _dense_causal(q, k, v, scale, q_offset, window=None):
    """q [qn, h, d], k/v [L, kvh, d] → [qn, h, d]; q row i sits at position q_offset + i."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    qp = torch.arange(q.shape[0])[:, None] + q_offset
    kp = torch.arange(k.shape[0])[None, :]
    mask = kp <= qp
    if window is not None:
        mask &= kp > qp - window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


def _scattered_cache(seqs, num_blocks, kvh, bs, d, gen):
    """Write each sequence's k/v into randomly chosen blocks of a strided cache view."""
    storage = torch.full((num_blocks, 3, 2, kvh, bs, d), float("nan"))
    cache = storage[:, 1]  # strided in the block dim, like the engine's per-layer views
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for k, v in seqs:
        nb = -(-k.shape[0] // bs)
        blocks = [perm.pop() for _ in range(nb)]
        tables.append(blocks)
        slots = torch.tensor([blocks[i // bs] * bs + i % bs for i in range(k.shape[0])])
        write_kv_cache_ref(k, v, cache, slots)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return cache, bt


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (4, 1)])
def test_decode_and_prefill_match_dense(heads, kv_heads, window):
    gen = torch.Generator().manual_seed(0)
    d, bs = 16, 4
    lens = [1, 4, 5, 13]
    qlens = [1, 2, 5, 7]
    seqs = [
        (torch.randn(n, kv_heads, d, generator=gen), torch.randn(n, kv_heads, d, generator=gen))
        for n in lens
    ]
    cache, bt = _scattered_cache(seqs, 32, kv_heads, bs, d, gen)
    scale = d**-0.5
    ctx = torch.tensor(lens, dtype=torch.int32)

    q_dec = torch.randn(len(lens), heads, d, generator=gen)
    out = decode_attention_ref(q_dec, cache, bt, ctx, scale, window)
    for s, (k, v) in enumerate(seqs):
        want = _dense_causal(q_dec[s : s + 1], k, v, scale, lens[s] - 1, window)
        torch.testing.assert_close(out[s : s + 1].double(), want, rtol=1e-5, atol=1e-5)

    q_pre = torch.randn(sum(qlens), heads, d, generator=gen)
    starts = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    out = prefill_attention_ref(q_pre, cache, bt, starts, ctx, scale, window)
    for s, (k, v) in enumerate(seqs):
        rows = slice(int(starts[s]), int(starts[s + 1]))
        want = _dense_causal(q_pre[rows], k, v, scale, lens[s] - qlens[s], window)
        torch.testing.assert_close(out[rows].double(), want, rtol=1e-5, atol=1e-5)


def test_paged_attention_mixes_decodes_and_prefills():
    gen = torch.Generator().manual_seed(1)
    heads, kvh, d, bs = 4, 2, 8, 4
    lens, qlens = [6, 9, 3], [1, 4, 3]
    full = [
        (torch.randn(n, kvh, d, generator=gen), torch.randn(n, kvh, d, generator=gen)) for n in lens
    ]
    # Lay out every token's block; paged_attention itself writes this step's tokens.
    cache, bt = _scattered_cache(full, 16, kvh, bs, d, gen)
    new = [slice(n - q, n) for n, q in zip(lens, qlens, strict=True)]
    for s, rows in enumerate(new):
        for pos in range(rows.start, rows.stop):
            block = int(bt[s, pos // bs])
            cache[block, :, :, pos % bs] = float("nan")
    slots, keys, values = [], [], []
    for s, ((k, v), n, q) in enumerate(zip(full, lens, qlens, strict=True)):
        for pos in range(n - q, n):
            slots.append(int(bt[s, pos // bs]) * bs + pos % bs)
        keys.append(k[n - q :])
        values.append(v[n - q :])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=bt,
        query_start_loc=torch.tensor([0, 1, 5, 8], dtype=torch.int32),
        context_lens=torch.tensor(lens, dtype=torch.int32),
        num_decode_seqs=1,
        max_query_len=4,
        max_context_len=9,
    )
    q = torch.randn(8, heads, d, generator=gen)
    out = paged_attention(q, torch.cat(keys), torch.cat(values), cache, meta, d**-0.5)
    for s, (k, v) in enumerate(full):
        rows = slice(int(meta.query_start_loc[s]), int(meta.query_start_loc[s + 1]))
        want = _dense_causal(q[rows], k, v, d**-0.5, lens[s] - qlens[s])
        torch.testing.assert_close(out[rows].double(), want, rtol=1e-5, atol=1e-5)


def test_write_kv_cache_skips_padding_slots():
    cache = torch.zeros(2, 2, 1, 2, 3)
    k = torch.ones(2, 1, 3)
    write_kv_cache_ref(k, 2 * k, cache, torch.tensor([3, -1]))
    assert cache[1, 0, 0, 1].eq(1).all() and cache[1, 1, 0, 1].eq(2).all()
    assert cache.sum() == 9


def test_rms_norm_with_residual():
    x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    normed, res = rms_norm_ref(x, w, 1e-6, r)
    torch.testing.assert_close(res, x + r)
    want = w * (x + r) / torch.sqrt(((x + r) ** 2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(normed, want)


def test_rotary_matches_rotate_half_form():
    d, positions = 8, torch.tensor([0, 3, 7])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(16).float(), inv)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    q, k = torch.randn(3, 2, d), torch.randn(3, 1, d)
    qr, kr = rotary_embedding_ref(positions, q, k, cache)
    emb = torch.cat((freqs, freqs), dim=-1)[positions][:, None]

    def rotate_half(x):
        return torch.cat((-x[..., d // 2 :], x[..., : d // 2]), dim=-1)

    torch.testing.assert_close(qr, q * emb.cos() + rotate_half(q) * emb.sin())
    torch.testing.assert_close(kr, k * emb.cos() + rotate_half(k) * emb.sin())
    torch.testing.assert_close(qr[0], q[0])
