"""The Triton kernels as torch operators (`torch.ops.pdserve.*`): the CUDA path of
`kernels/dispatch.py`.

Each operator's implementation launches its Triton kernel; its fake implementation
(what `FakeTensorMode` and torch.compile run instead) checks the inputs with the checks
the launch makes and returns outputs of the shapes, dtypes and device the kernel would
write. Tensors a kernel writes into (the KV cache, `out`) are mutated arguments, so an
operator returns only fresh tensors. The operators are defined with `torch.library.Library`
rather than `custom_op`: a call costs a dispatcher round trip (about 10 µs), where a
`custom_op` with mutated arguments costs tens of times more in Python per call.

The CPU path never goes through them: CPU tensors run the C kernels directly. The CPU
implementations registered here are the Triton kernels under Triton's interpreter
(TRITON_INTERPRET=1), which is how the tests run the operators without a GPU. Kernels
are looked up in their modules at each call, so a test that reloads a module under the
interpreter gets the reloaded kernel.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, ParamSpec

import torch

from pdserve.kernels import (
    reference,
    triton_activation,
    triton_decode,
    triton_kv_write,
    triton_norm,
    triton_prefill,
    triton_rotary,
)
from pdserve.kernels.op_args import DecodeAttention, PrefillAttention

Tensor = torch.Tensor
P = ParamSpec("P")

_LIB = torch.library.Library("pdserve", "DEF")
_SCHEMAS = {
    "write_kv_cache": "(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()",
    "decode_attention": "(Tensor query, Tensor kv_cache, Tensor block_tables, "
    "Tensor context_lens, float scale, int? sliding_window, Tensor(a!) out) -> ()",
    "prefill_attention": "(Tensor query, Tensor kv_cache, Tensor block_tables, "
    "Tensor query_start_loc, Tensor context_lens, float scale, int? sliding_window, "
    "Tensor(a!) out) -> ()",
    "rms_norm": "(Tensor x, Tensor weight, float eps) -> Tensor",
    "rms_norm_residual": "(Tensor x, Tensor weight, float eps, Tensor residual) "
    "-> (Tensor, Tensor)",
    "rotary_embedding": "(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache) "
    "-> (Tensor, Tensor)",
    "silu_and_mul": "(Tensor gate_up) -> Tensor",
}


def _write_kv_cache_impl(key: Tensor, value: Tensor, kv_cache: Tensor, slots: Tensor) -> None:
    triton_kv_write.write_kv_cache_triton(key, value, kv_cache, slots)


def _write_kv_cache_fake(key: Tensor, value: Tensor, kv_cache: Tensor, slots: Tensor) -> None:
    triton_kv_write.check_kv_write_inputs(key, value, kv_cache, slots)


# The attention schemas list their bundle's fields in order (less an FP8 cache's scales).
def _decode_impl(*args: Any) -> None:
    triton_decode.decode_attention_triton(*args)


def _decode_fake(*args: Any) -> None:
    triton_decode.check_decode_inputs(DecodeAttention(*args))


def _prefill_impl(*args: Any) -> None:
    triton_prefill.prefill_attention_triton(*args)


def _prefill_fake(*args: Any) -> None:
    triton_prefill.check_prefill_inputs(PrefillAttention(*args))


def _rms_norm_impl(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return triton_norm.rms_norm_triton(x, weight, eps)


def _rms_norm_fake(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return triton_norm.rms_norm_outputs(x, weight, None)[0]


def _rms_norm_residual_impl(x, weight, eps, residual) -> tuple[Tensor, Tensor]:
    return triton_norm.rms_norm_triton(x, weight, eps, residual)


def _rms_norm_residual_fake(x, weight, eps, residual) -> tuple[Tensor, Tensor]:
    return triton_norm.rms_norm_outputs(x, weight, residual)


def _rotary_impl(positions, query, key, cos_sin_cache) -> tuple[Tensor, Tensor]:
    return triton_rotary.rotary_embedding_triton(positions, query, key, cos_sin_cache)


def _rotary_fake(positions, query, key, cos_sin_cache) -> tuple[Tensor, Tensor]:
    return triton_rotary.rotary_outputs(positions, query, key, cos_sin_cache)


def _silu_and_mul_impl(gate_up: Tensor) -> Tensor:
    return triton_activation.silu_and_mul_triton(gate_up)


def _silu_and_mul_fake(gate_up: Tensor) -> Tensor:
    return triton_activation.silu_and_mul_outputs(gate_up)


_IMPLEMENTATIONS: dict[str, tuple[Callable[..., object], Callable[..., object]]] = {
    "write_kv_cache": (_write_kv_cache_impl, _write_kv_cache_fake),
    "decode_attention": (_decode_impl, _decode_fake),
    "prefill_attention": (_prefill_impl, _prefill_fake),
    "rms_norm": (_rms_norm_impl, _rms_norm_fake),
    "rms_norm_residual": (_rms_norm_residual_impl, _rms_norm_residual_fake),
    "rotary_embedding": (_rotary_impl, _rotary_fake),
    "silu_and_mul": (_silu_and_mul_impl, _silu_and_mul_fake),
}
for _name, (_impl, _fake) in _IMPLEMENTATIONS.items():
    _LIB.define(_name + _SCHEMAS[_name])
    _LIB.impl(_name, _impl, "CUDA")
    _LIB.impl(_name, _impl, "CPU")
    torch.library.register_fake(f"pdserve::{_name}", _fake, lib=_LIB)

_ops = torch.ops.pdserve
_write_kv_cache_op = _ops.write_kv_cache.default
_decode_op = _ops.decode_attention.default
_prefill_op = _ops.prefill_attention.default
_rms_norm_op = _ops.rms_norm.default
_rms_norm_residual_op = _ops.rms_norm_residual.default
_rotary_op = _ops.rotary_embedding.default
_silu_and_mul_op = _ops.silu_and_mul.default


# ---- the entry points dispatch registers: the references' signatures ------------------


def write_kv_cache(key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    _write_kv_cache_op(key, value, kv_cache, slot_mapping)


def _writing_out(op: Callable[..., None], reference_fn: Callable[P, Tensor]) -> Callable[P, Tensor]:
    """The entry point of an operator that writes into its last argument, `out`: the
    signature of the op's reference, `out` allocated like the query (the first argument)
    where the caller gives none."""
    signature = inspect.signature(reference_fn)
    # The keyword-only parameters (an FP8 cache's scales) have no CUDA kernel: the
    # engine refuses an FP8 KV cache on CUDA at startup, and a call naming them here
    # fails rather than having them ignored.
    positional = [
        p.name for p in signature.parameters.values() if p.kind != inspect.Parameter.KEYWORD_ONLY
    ]
    arity = len(positional)

    @functools.wraps(reference_fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> Tensor:
        values: tuple[Any, ...] = args
        if kwargs or len(args) != arity:  # the engine's calls pass every argument in order
            extra = sorted(set(kwargs) - set(positional))
            if extra:
                raise NotImplementedError(
                    f"{', '.join(extra)}: the CUDA kernels have no FP8 KV cache"
                )
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            values = tuple(bound.arguments[name] for name in positional)
        *inputs, out = values
        if out is None:
            out = torch.empty_like(inputs[0])
        op(*inputs, out)
        return out

    call.__name__ = call.__qualname__ = reference_fn.__name__.removesuffix("_ref")
    return call


decode_attention = _writing_out(_decode_op, reference.decode_attention_ref)
prefill_attention = _writing_out(_prefill_op, reference.prefill_attention_ref)


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    if residual is None:
        return _rms_norm_op(x, weight, eps)
    return _rms_norm_residual_op(x, weight, eps, residual)


def rotary_embedding(
    positions: Tensor, query: Tensor, key: Tensor, cos_sin_cache: Tensor
) -> tuple[Tensor, Tensor]:
    return _rotary_op(positions, query, key, cos_sin_cache)


def silu_and_mul(gate_up: Tensor) -> Tensor:
    return _silu_and_mul_op(gate_up)
