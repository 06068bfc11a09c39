"""Registers the Triton kernels with `pdserve.kernels.dispatch`, so CUDA tensors run them,
each through its torch operator (`pdserve.kernels.cuda_ops`: the kernel on a device, a
fake implementation under `FakeTensorMode`).

Importing this module needs triton; `pdserve.kernels.dispatch` imports it on the first CUDA
lookup and falls back to the references (with the reason kept) where triton is absent.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.kernels import cuda_ops, dispatch
from pdserve.kernels.reference import split_qkv


def rotary_write_kv_cache(
    positions: torch.Tensor,
    qkv: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """`reference.rotary_write_kv_cache_ref` as the rotary and KV-write kernels, one
    after the other (one launch each; a CUDA graph captures both)."""
    query, key, value = split_qkv(qkv, num_heads, kv_cache)
    query, key = cuda_ops.rotary_embedding(positions, query, key, cos_sin_cache)
    cuda_ops.write_kv_cache(key, value, kv_cache, slot_mapping)
    return query


TRITON_KERNELS: dict[str, Callable[..., object]] = {
    "write_kv_cache": cuda_ops.write_kv_cache,
    "decode_attention": cuda_ops.decode_attention,
    "prefill_attention": cuda_ops.prefill_attention,
    "rms_norm": cuda_ops.rms_norm,
    "rotary_embedding": cuda_ops.rotary_embedding,
    "rotary_write_kv_cache": rotary_write_kv_cache,
    "silu_and_mul": cuda_ops.silu_and_mul,
}


def register_all() -> None:
    for name, fn in TRITON_KERNELS.items():
        dispatch.register_triton(name, fn)


register_all()
