"""Paged attention and fused ops: Triton kernels with plain-torch references."""

from kernels.attention import (
    AttentionMetadata,
    decode_attention,
    paged_attention,
    prefill_attention,
    write_kv_cache,
)
from kernels.ops import rms_norm, rotary_embedding

__all__ = [
    "AttentionMetadata",
    "decode_attention",
    "paged_attention",
    "prefill_attention",
    "rms_norm",
    "rotary_embedding",
    "write_kv_cache",
]
