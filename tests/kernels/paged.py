"""Builders of paged KV caches and ragged batches for the kernel tests.

Every cache is a block-strided per-layer view of a block-major storage (as the engine
allocates it), poisoned with NaN wherever no token was written, so a kernel that reads
a slot past a context's end, or a block table entry past the last used one, fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pdserve.kernels.reference import write_kv_cache_ref

# Bounds for |triton - reference| against outputs of magnitude ~1. bf16 allows two
# ulps: the interpreter truncates fp32 -> bf16 where a GPU rounds to nearest, and
# the attention kernels round P to bf16 before the PV product.
TOLERANCE = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
    torch.bfloat16: {"atol": 2.5e-2, "rtol": 2.5e-2},
}
NUM_LAYERS = 3  # the tests use layer 1, the middle one

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# (heads, kv_heads, head_dim, block_size, dtype, window): an L9 orthogonal array over
# group x head_dim x dtype x (block size, window), so every pair of values meets; the
# decode and prefill kernels both run it.
PAIRWISE = [
    (4, 4, 64, 16, F32, None),
    (4, 4, 128, 32, F16, None),
    (4, 4, 256, 32, BF16, 7),
    (4, 2, 64, 32, BF16, None),
    (4, 2, 128, 32, F32, 7),
    (4, 2, 256, 16, F16, None),
    (4, 1, 64, 32, F16, 7),
    (4, 1, 128, 16, BF16, None),
    (4, 1, 256, 32, F32, None),
    # A group of 3 (SmolLM2's 9 heads over 3 kv heads): a padded GQA tile.
    (6, 2, 64, 16, BF16, 20),
]


def over_attention_cases(cases: list[tuple]) -> pytest.MarkDecorator:
    """Parametrizes a test over (heads, kv_heads, head_dim, block_size, dtype, window)."""
    return pytest.mark.parametrize(
        "heads,kv_heads,head_dim,block_size,dtype,window", cases, ids=map(_case_id, cases)
    )


def _case_id(case: tuple) -> str:
    heads, kv_heads, d, bs, dtype, window = case
    return f"h{heads}kv{kv_heads}-d{d}-bs{bs}-{str(dtype)[6:]}-w{window}"


@dataclass
class PagedBatch:
    kv_cache: torch.Tensor  # [num_blocks, 2, kv_heads, block_size, head_dim], strided
    block_tables: torch.Tensor  # [num_seqs, width] int32
    context_lens: torch.Tensor  # [num_seqs] int32


def require_interpreter(kernel) -> None:
    """Fail loudly if the kernels were compiled for a GPU instead of interpreted."""
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kernel, InterpretedFunction):
        pytest.fail("pdserve.kernels.triton_* was imported before TRITON_INTERPRET=1 was set")


def make_paged_batch(
    context_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    spare_blocks: int = 3,
    extra_width: int = 1,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> PagedBatch:
    """Each sequence's tokens scattered over random blocks of a NaN-poisoned cache.

    The block table is `extra_width` entries wider than the longest sequence needs;
    entries past a sequence's own blocks point at random blocks (others' or unused).
    An FP8 cache is written with the scales given.
    """
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(needed) + spare_blocks
    storage = torch.full(
        (num_blocks, NUM_LAYERS, 2, num_kv_heads, block_size, head_dim), float("nan"), dtype=dtype
    )
    kv_cache = storage[:, 1]
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(needed) + extra_width
    tables = []
    for n, nb in zip(context_lens, needed, strict=True):
        blocks = [order.pop() for _ in range(nb)]
        slots = torch.tensor(
            [blocks[i // block_size] * block_size + i % block_size for i in range(n)]
        )
        key = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        value = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        scales = {"k_scale": k_scale, "v_scale": v_scale} if dtype.itemsize == 1 else {}
        write_kv_cache_ref(key, value, kv_cache, slots, **scales)
        filler = torch.randint(0, num_blocks, (width - nb,), generator=gen).tolist()
        tables.append(blocks + filler)
    return PagedBatch(
        kv_cache=kv_cache,
        block_tables=torch.tensor(tables, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
    )


def poisoned_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.full_like(tensor, float("nan"))


def assert_matches(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not got.isnan().any(), "an output element was left unwritten (NaN)"
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])
