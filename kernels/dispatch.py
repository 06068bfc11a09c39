"""Picks an implementation of a kernel by the device of its input.

CPU → the torch reference. CUDA → the Triton kernel registered for that name, or the
reference when none is registered yet (so the GPU path works before every kernel has
a Triton version). Registration happens when `kernels.triton_ops` is imported.
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


def register_triton(name: str, fn: Callable[..., Any]) -> None:
    if name not in _REFERENCE:
        raise KeyError(f"unknown kernel {name!r}")
    _TRITON[name] = fn


def lookup(name: str, like: torch.Tensor) -> Callable[..., Any]:
    if like.is_cuda and name in _TRITON:
        return _TRITON[name]
    return _REFERENCE[name]
