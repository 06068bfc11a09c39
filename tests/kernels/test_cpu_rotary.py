"""The CPU rotary + KV-write kernel against its torch reference, bit for bit: the
rotation is a product-then-sum per element with no fused multiply-add, so a float32
model's queries and cache hold exactly what the reference computes."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.models.rope import cos_sin_cache
from pdserve.kernels.cpu_layer_ops import CpuLayerOps
from pdserve.kernels.reference import rotary_write_kv_cache_ref
from tests.kernels.paged import make_paged_batch

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.fixture(scope="module")
def ops(kernels) -> CpuLayerOps:
    return CpuLayerOps(kernels)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.dtype == F32 else torch.int16)


def _case(heads, kv_heads, d, tokens, src, cache_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    batch = make_paged_batch([tokens], kv_heads, d, 16, cache_dtype, gen, spare_blocks=4)
    width = (heads + 2 * kv_heads) * d
    # A column slice of a wider tensor: rows strided as a TP slice or a padded row is.
    qkv = torch.randn(tokens, width + 8, generator=gen)[:, :width].to(src)
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    slots = torch.randperm(batch.kv_cache.shape[0] * 16, generator=gen)[:tokens]
    slots[::5] = -1  # padding: rotated query, nothing written
    table = cos_sin_cache(d, 4096, 10000.0, None)
    return qkv, positions, table, batch.kv_cache, slots


@pytest.mark.parametrize(
    ("heads", "kv_heads", "d", "tokens", "src", "cache_dtype"),
    [
        (9, 3, 64, 1, F32, BF16),  # SmolLM2-135M decode, bf16 serving dtype
        (9, 3, 64, 7, F32, F32),  # float32 model
        (8, 2, 128, 300, F32, BF16),  # enough tokens for the threaded path
        (4, 4, 72, 5, BF16, BF16),
        (6, 2, 36, 4, F16, F16),
    ],
)
def test_matches_reference_bit_for_bit(ops, threads, heads, kv_heads, d, tokens, src, cache_dtype):
    threads(2)
    qkv, positions, table, cache, slots = _case(heads, kv_heads, d, tokens, src, cache_dtype, d)
    want_cache = cache.clone()
    want = rotary_write_kv_cache_ref(positions, qkv, table, want_cache, slots, heads)
    got = ops.rotary_write_kv_cache(positions, qkv, table, cache, slots, heads)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(_bits(got), _bits(want))
    assert torch.equal(_bits(cache), _bits(want_cache))  # NaN poison untouched included


def test_a_token_does_not_depend_on_the_others(ops):
    qkv, positions, table, cache, slots = _case(9, 3, 64, 6, F32, BF16, 1)
    whole = ops.rotary_write_kv_cache(positions, qkv, table, cache.clone(), slots, 9)
    one = ops.rotary_write_kv_cache(positions[3:4], qkv[3:4], table, cache, slots[3:4], 9)
    assert torch.equal(whole[3:4], one)


def test_bad_inputs_are_refused(ops):
    qkv, positions, table, cache, slots = _case(9, 3, 64, 2, F32, BF16, 2)
    with pytest.raises(ValueError, match="qkv must be"):
        ops.rotary_write_kv_cache(positions, qkv[:, :-64], table, cache, slots, 9)
    with pytest.raises(ValueError, match=r"positions\[1\]"):
        far = torch.tensor([0, 4096])
        ops.rotary_write_kv_cache(far, qkv, table, cache, slots, 9)
    with pytest.raises(ValueError, match=r"slot_mapping\[0\]"):
        past = torch.tensor([cache.shape[0] * 16, 0])
        ops.rotary_write_kv_cache(positions, qkv, table, cache, past, 9)
    with pytest.raises(ValueError, match="positions must be"):
        ops.rotary_write_kv_cache(positions[:1], qkv, table, cache, slots, 9)
