"""Triton KV-cache write, RMSNorm, rotary embedding and SiLU-and-multiply against the
references."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.reference import (
    rms_norm_ref,
    rotary_embedding_ref,
    silu_and_mul_ref,
    write_kv_cache_ref,
)
from pdserve.kernels.triton_activation import silu_and_mul_kernel, silu_and_mul_triton
from pdserve.kernels.triton_kv_write import write_kv_cache_kernel, write_kv_cache_triton
from pdserve.kernels.triton_norm import rms_norm_kernel, rms_norm_triton
from pdserve.kernels.triton_rotary import rotary_embedding_kernel, rotary_embedding_triton
from tests.kernels.paged import TOLERANCE, require_interpreter

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# One ulp: the interpreter truncates fp32 -> bf16 where torch rounds to nearest.
ONE_ULP = {F32: 0.0, F16: 0.0, BF16: 2.0**-7}


@pytest.mark.parametrize(
    "kv_heads,head_dim,block_size,dtype",
    [(1, 64, 16, F32), (2, 128, 32, F16), (3, 256, 16, BF16), (8, 80, 5, F32)],
)
def test_kv_write_matches_reference_in_a_strided_cache(kv_heads, head_dim, block_size, dtype):
    require_interpreter(write_kv_cache_kernel)
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks, tokens = 6, 9
    storage = torch.randn(num_blocks, 3, 2, kv_heads, block_size, head_dim, generator=gen)
    storage = storage.to(dtype)
    # Key/value as views into a fused projection, in fp32 where the cache converts
    # (the interpreter truncates fp32 -> bf16, so bf16 caches get bf16 inputs).
    qkv = torch.randn(tokens, 1 + 2 * kv_heads, head_dim, generator=gen)
    qkv = qkv.to(BF16) if dtype == BF16 else qkv
    key, value = qkv[:, 1 : 1 + kv_heads], qkv[:, 1 + kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[2, 5]] = -1  # padding tokens write nothing
    want = storage.clone()
    write_kv_cache_ref(key, value, want[:, 1], slots)
    got = storage.clone()
    write_kv_cache_triton(key, value, got[:, 1], slots)
    assert torch.equal(got, want)  # a pure copy: bit-exact, other layers untouched
    assert not torch.equal(got, storage)


def test_kv_write_rejects_mismatched_slots():
    cache = torch.zeros(2, 2, 1, 4, 8)
    key = torch.zeros(3, 1, 8)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache_triton(key, key, cache, torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize(
    "shape,dtype,weight_dtype,with_residual",
    [
        ((5, 96), F32, F32, False),
        ((3, 4, 64), F16, F16, True),
        ((7, 576), BF16, BF16, True),
        ((2, 4096), BF16, F32, False),  # fp32 weight promotes the result, as in torch
        ((1, 1000), F16, F32, True),  # hidden size that is no power of two
    ],
)
def test_rms_norm_matches_reference(shape, dtype, weight_dtype, with_residual):
    require_interpreter(rms_norm_kernel)
    gen = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(shape, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(weight_dtype)
    residual = torch.randn(shape, generator=gen).to(dtype) if with_residual else None
    got = rms_norm_triton(x, weight, 1e-6, residual)
    want = rms_norm_ref(x, weight, 1e-6, residual)
    if with_residual:
        (got, got_res), (want, want_res) = got, want
        assert got_res.dtype == want_res.dtype
        torch.testing.assert_close(got_res, want_res, atol=0, rtol=ONE_ULP[dtype])
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])


def test_rms_norm_rejects_a_wrong_weight():
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(torch.randn(2, 8), torch.ones(4), 1e-6)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,dtype,cache_dtype",
    [(4, 4, 64, F32, F32), (9, 3, 64, BF16, F32), (4, 1, 128, F16, F32), (2, 2, 256, BF16, BF16)],
)
def test_rotary_matches_reference_on_strided_views(heads, kv_heads, head_dim, dtype, cache_dtype):
    require_interpreter(rotary_embedding_kernel)
    gen = torch.Generator().manual_seed(heads * head_dim)
    tokens, max_pos = 6, 40
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(max_pos).float(), inv)
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1).to(cache_dtype)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    query, key = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
    positions = torch.tensor([0, 1, 39, 7, 7, 20])
    got_q, got_k = rotary_embedding_triton(positions, query, key, cache)
    want_q, want_k = rotary_embedding_ref(positions, query, key, cache)
    for got, want in ((got_q, want_q), (got_k, want_k)):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])
    torch.testing.assert_close(got_q[0], query[0])  # position 0 is the identity


def test_rotary_rejects_a_cache_of_another_head_dim():
    q = torch.randn(2, 2, 64)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary_embedding_triton(torch.zeros(2, dtype=torch.int64), q, q, torch.zeros(8, 32))


def test_fused_rotary_and_kv_write_runs_the_two_kernels():
    """The CUDA path of `rotary_write_kv_cache`: the Triton rotary, then the Triton KV
    write, on views of one fused QKV row (run here through the operators' interpreter
    implementations)."""
    from pdserve.kernels import triton_ops
    from pdserve.kernels.reference import rotary_write_kv_cache_ref

    require_interpreter(rotary_embedding_kernel)
    require_interpreter(write_kv_cache_kernel)
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, d, bs, tokens = 9, 3, 64, 16, 5
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.outer(torch.arange(64).float(), inv)
    table = torch.cat((angles.cos(), angles.sin()), dim=-1)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen)
    positions = torch.tensor([0, 3, 63, 7, 7])
    slots = torch.tensor([1, 17, -1, 40, 2])
    want_cache = torch.zeros(4, 2, kv_heads, bs, d)
    got_cache = want_cache.clone()
    want = rotary_write_kv_cache_ref(positions, qkv, table, want_cache, slots, heads)
    got = triton_ops.rotary_write_kv_cache(positions, qkv, table, got_cache, slots, heads)
    torch.testing.assert_close(got, want, **TOLERANCE[F32])
    torch.testing.assert_close(got_cache, want_cache, **TOLERANCE[F32])


@pytest.mark.parametrize(
    "shape,dtype",
    [((5, 2 * 96), F32), ((3, 4, 2 * 64), F16), ((7, 2 * 1536), BF16), ((1, 2 * 1000), F32)],
)
def test_silu_and_mul_matches_reference(shape, dtype):
    require_interpreter(silu_and_mul_kernel)
    gen = torch.Generator().manual_seed(shape[-1])
    gate_up = (4 * torch.randn(shape, generator=gen)).to(dtype)
    got, want = silu_and_mul_triton(gate_up), silu_and_mul_ref(gate_up)
    assert got.dtype == want.dtype and got.shape == want.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])


def test_silu_and_mul_reads_rows_of_a_strided_input():
    require_interpreter(silu_and_mul_kernel)
    wide = torch.randn(6, 3 * 64)
    gate_up = wide[:, :128]  # rows 192 apart, columns contiguous
    torch.testing.assert_close(
        silu_and_mul_triton(gate_up), silu_and_mul_ref(gate_up), **TOLERANCE[F32]
    )


def test_silu_and_mul_rejects_an_odd_width():
    with pytest.raises(ValueError, match="even"):
        silu_and_mul_triton(torch.randn(2, 7))
