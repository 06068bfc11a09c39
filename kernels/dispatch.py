"""Picks an implementation of a kernel by the device of its input.

CPU → the C kernel registered for that name (`pdserve.kernels.cpu_ops`, built and loaded on
the first CPU lookup), or the reference when none is registered, when the build
failed (logged once, with the compiler's error) or when PDSERVE_CPU_KERNELS=0.
CUDA → the Triton kernel registered for that name, or the reference when none is
registered (so the GPU path works before every kernel has a Triton version, and
where triton is not installed). The Triton kernels register themselves when
`pdserve.kernels.triton_ops` is imported, which happens on the first CUDA lookup (or
explicitly through `load_triton_kernels`), so CPU-only processes never import triton.
The references stay the definition of every op and the oracle of the tests.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch

from pdserve.kernels import gguf_blocks, lanes, reference

_REFERENCE: dict[str, Callable[..., Any]] = {
    "write_kv_cache": reference.write_kv_cache_ref,
    "decode_attention": reference.decode_attention_ref,
    "prefill_attention": reference.prefill_attention_ref,
    "rms_norm": reference.rms_norm_ref,
    "silu_and_mul": reference.silu_and_mul_ref,
    "rotary_embedding": reference.rotary_embedding_ref,
    "rotary_write_kv_cache": reference.rotary_write_kv_cache_ref,
    "linear": reference.linear_ref,
    "linear_int8": reference.linear_int8_ref,
    "linear_lanes": lanes.linear_lanes_ref,
    "linear_gguf": gguf_blocks.linear_gguf_ref,
    "gguf_rows": gguf_blocks.gguf_rows_ref,
}
_TRITON: dict[str, Callable[..., Any]] = {}
_load_attempted = False
_unavailable_reason: str | None = None
_triton_enabled = True
_CPU: dict[str, Callable[..., Any]] = {}
_cpu_load_attempted = False
_cpu_unavailable_reason: str | None = None
_cpu_description = ""
_cpu_loaded: Any = None  # the loaded `cpu_ops.CpuKernels`
_cpu_enabled = os.environ.get("PDSERVE_CPU_KERNELS", "1") != "0"
_log = logging.getLogger("pdserve.kernels")

P = ParamSpec("P")
R = TypeVar("R")


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
            import pdserve.kernels.triton_ops  # noqa: F401  (registers on import)
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


def register_cpu(name: str, fn: Callable[..., Any]) -> None:
    if name not in _REFERENCE:
        raise KeyError(f"unknown kernel {name!r}")
    _CPU[name] = fn


def load_cpu_kernels() -> bool:
    """Build (first time), load and register the C kernels once; False (reason kept
    and logged once) if that fails."""
    global _cpu_load_attempted, _cpu_unavailable_reason, _cpu_description, _cpu_loaded
    if not _cpu_load_attempted:
        _cpu_load_attempted = True
        from pdserve.kernels import cpu_build, cpu_ops

        try:
            loaded = cpu_ops.load()
        except cpu_build.BuildError as exc:
            _cpu_unavailable_reason = str(exc)
            _log.warning("CPU attention runs the torch references: %s", exc)
        else:
            cpu_ops.register(loaded)
            _cpu_description = loaded.describe()
            _cpu_loaded = loaded
    return _cpu_unavailable_reason is None


def cpu_kernels() -> Any:
    """The loaded `cpu_ops.CpuKernels` the CPU ops run, or None where they run the
    references (kernels off, or the build failed)."""
    return _cpu_loaded if _cpu_enabled and load_cpu_kernels() else None


def set_cpu_kernels_enabled(enabled: bool) -> None:
    """Route CPU tensors to the references (False) or the C kernels (True), e.g. to
    compare an engine's output on both. PDSERVE_CPU_KERNELS=0 sets False at start."""
    global _cpu_enabled
    _cpu_enabled = enabled


def cpu_kernels_status() -> str:
    """Which implementation CPU attention runs, for startup logs and /health."""
    if not _cpu_enabled:
        return "torch references (C kernels off: PDSERVE_CPU_KERNELS=0 or set_cpu_kernels_enabled)"
    if not load_cpu_kernels():
        return f"torch references ({_cpu_unavailable_reason})"
    return _cpu_description


def lookup(name: str, like: torch.Tensor) -> Callable[..., Any]:
    if like.is_cuda:
        if _triton_enabled:
            load_triton_kernels()
            if name in _TRITON:
                return _TRITON[name]
    elif _cpu_enabled and like.is_cpu and (_CPU or load_cpu_kernels()) and name in _CPU:
        return _CPU[name]
    return _REFERENCE[name]


def dispatched(reference_fn: Callable[P, R], like: int = 0) -> Callable[P, R]:
    """The public entry point of an op: the signature and documentation of its reference
    (the definition), the implementation looked up per call by the device of argument
    number `like` (positional, or by its name)."""
    name = reference_fn.__name__.removesuffix("_ref")
    like_name = list(inspect.signature(reference_fn).parameters)[like]

    @functools.wraps(reference_fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        tensor = args[like] if len(args) > like else kwargs[like_name]
        return lookup(name, tensor)(*args, **kwargs)  # type: ignore[arg-type]

    call.__name__ = call.__qualname__ = name
    # Named after the module that defines it (as collections.namedtuple does), so that
    # pickle and introspection find it there.
    call.__module__ = sys._getframe(1).f_globals.get("__name__", call.__module__)
    return call
