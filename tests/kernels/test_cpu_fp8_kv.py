"""An FP8 KV cache (e4m3 and e5m2) in the CPU C kernels against the torch references.

The write (alone, and fused with the rotation) stores exactly the reference's bytes:
every representable value, every midpoint between two (rounding to nearest even),
subnormals, and values past the format's range, which saturate at its largest finite
value, never inf or NaN. Decode and prefill attention read the bytes back with the
layer's scales (folded into the query and the output row: float32 rounding apart from
the reference's), and a prompt token's prefill row equals its decode step bit for bit.
The AVX2 build runs `check_fp8_kv` too (test_cpu_kernels.py's child process).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.models.rope import cos_sin_cache
from pdserve.kernels.cpu_layer_ops import CpuLayerOps
from pdserve.kernels.reference import (
    decode_attention_ref,
    prefill_attention_ref,
    rotary_write_kv_cache_ref,
    write_kv_cache_ref,
)
from tests.kernels.paged import make_paged_batch, poisoned_like

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [E4M3, E5M2]
SCALES = {"k_scale": 0.5, "v_scale": 3.0}
# Outputs are float32 from float32 queries: the reference widens the cache and scales it,
# the kernel folds the scales into the query and the output row (a few float32 ulps).
TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


def _every_value_and_midpoint(dtype: torch.dtype) -> torch.Tensor:
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    values = values[values.isfinite()].unique().sort().values
    midpoints = (values[1:] + values[:-1]) / 2  # ties: round to even
    beyond = torch.tensor([1e6, -1e6, float("inf"), -float("inf"), 1e-30, -1e-30])
    return torch.cat([values, midpoints, beyond])


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_write_stores_the_references_bytes_and_saturates(kernels, threads, dtype, scale):
    threads(2)
    x = _every_value_and_midpoint(dtype)
    x = torch.cat([x, torch.randn(64 * 64 - x.numel()) * 50])[: 64 * 64].view(64, 1, 64)
    got = torch.zeros(5, 2, 1, 16, 64, dtype=dtype)
    want = got.clone()
    slots = torch.arange(64)
    kernels.write_kv_cache(x, -x, got, slots, k_scale=scale, v_scale=scale)
    write_kv_cache_ref(x, -x, want, slots, k_scale=scale, v_scale=scale)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    keys = got[:, 0, 0].reshape(-1, 64)[:64].float()  # slot t holds token t
    assert keys.isfinite().all() and got[:, 1].float().isfinite().all()
    far = x[:, 0].abs() >= 1e6  # 1e6 and inf, however scaled: the largest finite value
    largest = torch.finfo(dtype).max
    assert far.sum() == 4 and torch.equal(keys[far], x[:, 0][far].sign() * largest)


def test_rotary_write_stores_the_references_bytes(kernels):
    ops = CpuLayerOps(kernels)
    gen = torch.Generator().manual_seed(3)
    for dtype in FP8:
        batch = make_paged_batch([20], 3, 64, 16, dtype, gen, spare_blocks=2, **SCALES)
        qkv = torch.randn(20, 15 * 64, generator=gen) * 30
        positions = torch.randint(0, 1000, (20,), generator=gen)
        slots = torch.randperm(batch.kv_cache.shape[0] * 16, generator=gen)[:20]
        table = cos_sin_cache(64, 1024, 10000.0, None)
        want_cache = batch.kv_cache.clone()
        want = rotary_write_kv_cache_ref(positions, qkv, table, want_cache, slots, 9, **SCALES)
        got = ops.rotary_write_kv_cache(positions, qkv, table, batch.kv_cache, slots, 9, **SCALES)
        assert torch.equal(got, want)
        assert torch.equal(batch.kv_cache.view(torch.uint8), want_cache.view(torch.uint8))


# (heads, kv_heads, head_dim, block_size, window): both specialised head_dims, one at
# run time and one with a scalar tail; groups of one, three and five heads.
SHAPES = [(9, 3, 64, 16, None), (8, 2, 128, 32, 40), (4, 4, 72, 16, None), (5, 1, 36, 16, 7)]


def check_fp8_kv(kernels) -> None:
    """Decode and prefill over an FP8 cache of each format against the references."""
    for dtype in FP8:
        for heads, kv_heads, d, bs, window in SHAPES:
            gen = torch.Generator().manual_seed(d + bs)
            lens = [bs + 1, 1, 2 * bs + 5, 70]
            batch = make_paged_batch(lens, kv_heads, d, bs, dtype, gen, **SCALES)
            args = (batch.kv_cache, batch.block_tables)
            query = torch.randn(len(lens), heads, d, generator=gen)
            out = poisoned_like(query)
            kernels.decode_attention(query, *args, batch.context_lens, d**-0.5, window, out,
                                     **SCALES)  # fmt: skip
            want = decode_attention_ref(query, *args, batch.context_lens, d**-0.5, window,
                                        **SCALES)  # fmt: skip
            torch.testing.assert_close(out, want, **TOLERANCE)
            starts = torch.tensor([0, 1, 2, 2 + bs, 9 + bs], dtype=torch.int32)
            query = torch.randn(9 + bs, heads, d, generator=gen)
            out = poisoned_like(query)
            kernels.prefill_attention(query, *args, starts, batch.context_lens, d**-0.5, window,
                                      out, **SCALES)  # fmt: skip
            want = prefill_attention_ref(query, *args, starts, batch.context_lens, d**-0.5,
                                         window, **SCALES)  # fmt: skip
            torch.testing.assert_close(out, want, **TOLERANCE)


def test_decode_and_prefill_match_the_references(kernels, threads):
    threads(1)
    check_fp8_kv(kernels)


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_prefill_rows_equal_decode_steps(kernels, threads, dtype):
    """The invariant of ARCHITECTURE.md holds over FP8 too: one arithmetic for both."""
    threads(2)
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, d, total = 9, 3, 64, 70
    batch = make_paged_batch([total], kv_heads, d, 16, dtype, gen, **SCALES)
    query = torch.randn(total, heads, d, generator=gen)
    cache, tables = batch.kv_cache, batch.block_tables
    steps = torch.cat([
        kernels.decode_attention(query[p : p + 1], cache, tables,
                                 torch.tensor([p + 1], dtype=torch.int32), 0.125, **SCALES)
        for p in range(total)
    ])  # fmt: skip
    for chunk in (total, 9):
        for start in range(0, total, chunk):
            end = min(total, start + chunk)
            starts = torch.tensor([0, end - start], dtype=torch.int32)
            lens = torch.tensor([end], dtype=torch.int32)
            out = kernels.prefill_attention(query[start:end], cache, tables, starts, lens, 0.125,
                                            **SCALES)  # fmt: skip
            assert torch.equal(out, steps[start:end]), (chunk, start)


def test_scales_are_refused_where_they_cannot_apply(kernels):
    key = torch.randn(2, 1, 64)
    bf16 = torch.zeros(1, 2, 1, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="k_scale/v_scale apply to an FP8 KV cache"):
        kernels.write_kv_cache(key, key, bf16, torch.arange(2), k_scale=2.0)
    fp8 = torch.zeros(1, 2, 1, 16, 64, dtype=E4M3)
    with pytest.raises(ValueError, match="must be positive"):
        kernels.write_kv_cache(key, key, fp8, torch.arange(2), v_scale=0.0)
