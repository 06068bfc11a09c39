"""Paged attention and fused ops: Triton kernels with plain-torch references.

Importing `kernels` never imports triton: CUDA calls load the Triton kernels on first
use (`load_triton_kernels`), and where triton is missing they run the references and
`triton_unavailable_reason()` says why. CPU calls run C kernels built on first use
(`pdserve.kernels.cpu_ops`); `cpu_kernels_status()` says which implementation is active.
PDSERVE_CPU_ISA=avx2 runs an AVX-512 machine on the AVX2 kernels (checked here).
"""

from pdserve.kernels.attention import (
    AttentionMetadata,
    attend_cached,
    decode_attention,
    paged_attention,
    prefill_attention,
    rotary_write_kv_cache,
    write_kv_cache,
)
from pdserve.kernels.cpu_build import apply_isa
from pdserve.kernels.dispatch import (
    cpu_kernels_status,
    load_triton_kernels,
    triton_unavailable_reason,
)
from pdserve.kernels.ops import linear, rms_norm, rotary_embedding

apply_isa()  # before torch's first vectorised op, which reads the capability once

__all__ = [
    "AttentionMetadata",
    "attend_cached",
    "cpu_kernels_status",
    "decode_attention",
    "linear",
    "load_triton_kernels",
    "paged_attention",
    "prefill_attention",
    "rms_norm",
    "rotary_embedding",
    "rotary_write_kv_cache",
    "triton_unavailable_reason",
    "write_kv_cache",
]
