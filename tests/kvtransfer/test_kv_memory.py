from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.engine.kv_cache import KVCache, KVCacheShape
from pdserve.kvtransfer.kv_memory import KVMemory
from pdserve.kvtransfer.layout import KVLayoutMismatch, layout_of


def _cache(dtype: torch.dtype = torch.bfloat16, heads: int = 4) -> KVCache:
    cache = KVCache(KVCacheShape(3, heads, 8, 4, dtype), num_blocks=10)
    generator = torch.Generator().manual_seed(0)
    cache.storage.view(torch.uint8).copy_(
        torch.randint(0, 256, cache.storage.view(torch.uint8).shape, generator=generator)
    )
    return cache


def test_blocks_are_zero_copy_views_of_the_kv_cache():
    cache = _cache()
    memory = KVMemory(cache.storage, layout_of(cache.shape))
    run = memory.blocks(2, 3)
    assert isinstance(run, np.ndarray) and run.flags["C_CONTIGUOUS"]
    assert run.nbytes == 3 * cache.shape.bytes_per_block
    assert run.reshape(-1).tobytes() == b"".join(
        cache.block_bytes(b).numpy().tobytes() for b in (2, 3, 4)
    )
    run[0] = 0  # writes land in the cache itself
    assert not cache.block_bytes(2).any()


def test_gather_then_scatter_moves_one_head_slice_per_layer():
    src, dst = _cache(torch.float32), KVCache(KVCacheShape(3, 2, 8, 4, torch.float32), 10)
    source = KVMemory(src.storage, layout_of(src.shape))
    # dst is rank 1 of TP 2: it holds global heads 2..3
    target = KVMemory(dst.storage, layout_of(dst.shape, tp_size=2), tp_size=2)
    staged = source.gather(5, 2, 2, 4)
    target.scatter(staged, 7, 0, 2)
    for layer in range(3):
        torch.testing.assert_close(dst.layers[layer][7:9], src.layers[layer][5:7, :, 2:4])
    assert not dst.storage[:7].any() and not dst.storage[9:].any()


def test_storage_that_does_not_match_the_layout_is_refused():
    cache = _cache()
    wrong = layout_of(KVCacheShape(3, 4, 16, 4, torch.bfloat16))
    with pytest.raises(KVLayoutMismatch, match="does not match the layout"):
        KVMemory(cache.storage, wrong)
    fp32 = layout_of(KVCacheShape(3, 4, 8, 4, torch.float32))
    with pytest.raises(KVLayoutMismatch, match="2-byte elements, layout says float32"):
        KVMemory(cache.storage, fp32)
    memory = KVMemory(cache.storage, layout_of(cache.shape))
    with pytest.raises(IndexError, match=r"blocks \[8, 11\) outside the KV pool of 10"):
        memory.blocks(8, 3)
