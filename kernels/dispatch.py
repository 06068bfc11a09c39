"""Picks an implementation of a kernel by the device of its input.

CPU → the torch reference. CUDA → the Triton kernel registered for that name, or the
reference when none is registered (so the GPU path works before every kernel has a
Triton version, and where triton is not installed). The Triton kernels register
themselves when `kernels.triton_ops` is imported, which happens on the first CUDA
lookup (or explicitly through `load_triton_kernels`), so CPU-only processes never
import triton.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kernels import reference

_REFERENCE: dict[str, Callable[..., Any]] = {
    "write_kv_cache": reference.write_kv_cache_ref,
    "decode_attention": reference.decode_attention_ref,
    "prefill_attention": reference.prefill_attention_ref,
    "rms_norm": reference.rms_norm_ref,
    "rotary_embedding": reference.rotary_embedding_ref,
}
_TRITON: dict[str, Callable[..., Any]] = {}
_load_attempted = False
_unavailable_reason: str | None = None
_triton_enabled = True


def register_triton(name: str, fn: Callable[..., Any]) -> None:
    if name not in _REFERENCE:
        raise KeyError(f"unknown kernel {name!r}")
    _TRITON[name] = fn


def load_triton_kernels() -> bool:
    """Import and register the Triton kernels once; False (reason kept) if unavailable."""
    global _load_attempted, _unavailable_reason
    if not _load_attempted:
        _load_attempted = True
        try:
            import kernels.triton_ops  # noqa: F401  (registers on import)
        except ImportError as exc:
            _unavailable_reason = f"triton kernels unavailable ({exc}); using torch references"
    return _unavailable_reason is None


def triton_unavailable_reason() -> str | None:
    """Why CUDA tensors run the references, or None when the Triton kernels loaded."""
    return _unavailable_reason


def set_triton_enabled(enabled: bool) -> None:
    """Route CUDA tensors to the references too (False), e.g. to compare an engine's
    output with Triton kernels against the same engine on the references."""
    global _triton_enabled
    _triton_enabled = enabled


def lookup(name: str, like: torch.Tensor) -> Callable[..., Any]:
    if like.is_cuda and _triton_enabled:
        load_triton_kernels()
        if name in _TRITON:
            return _TRITON[name]
    return _REFERENCE[name]
