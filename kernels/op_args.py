"""The paged-cache ops' arguments as one bundle each: every op's signature written once.

A bundle's constructor is its op's signature (the contract `attention.py` exports). The
reference, the C binding and the Triton launch of an op each take its bundle, and
`unpacks` gives them the bundle's fields as their parameters, so callers pass flat
arguments everywhere (the torch operators of `cuda_ops` need them flat). Building one
costs under a microsecond a call."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch

Tensor = torch.Tensor
P = ParamSpec("P")
A = TypeVar("A")
R = TypeVar("R")
S = TypeVar("S")


@dataclass(slots=True, kw_only=True)
class KVScales:
    """An FP8 cache's per-layer scales, keyword-only in every op; a 16/32-bit cache
    takes none (`reference` says how they apply)."""

    k_scale: float = 1.0
    v_scale: float = 1.0


@dataclass(slots=True)
class WriteKV(KVScales):
    """`write_kv_cache`: key/value [num_tokens, num_kv_heads, head_dim] to their slots."""

    key: Tensor
    value: Tensor
    kv_cache: Tensor
    slot_mapping: Tensor


@dataclass(slots=True)
class RotaryWriteKV(KVScales):
    """`rotary_write_kv_cache`: a fused QKV projection's output [T, (num_heads + 2 *
    num_kv_heads) * head_dim] rotated at `positions`, its keys and values to their slots."""

    positions: Tensor
    qkv: Tensor
    cos_sin_cache: Tensor
    kv_cache: Tensor
    slot_mapping: Tensor
    num_heads: int


@dataclass(slots=True)
class PagedAttention(KVScales):
    """What both attention ops take first: the queries [rows, num_heads, head_dim], the
    layer's cache and each sequence's block table."""

    query: Tensor
    kv_cache: Tensor
    block_tables: Tensor


@dataclass(slots=True)
class DecodeAttention(PagedAttention):
    """`decode_attention`: one query row per sequence."""

    context_lens: Tensor
    scale: float
    sliding_window: int | None = None
    out: Tensor | None = None


@dataclass(slots=True)
class PrefillAttention(PagedAttention):
    """`prefill_attention`: sequence s owns the query rows
    query_start_loc[s]:query_start_loc[s+1]."""

    query_start_loc: Tensor
    context_lens: Tensor
    scale: float
    sliding_window: int | None = None
    out: Tensor | None = None


Attention = DecodeAttention | PrefillAttention


def output(op: Attention) -> Tensor:
    """`op.out`, or a fresh tensor like the query where the caller gave none."""
    return torch.empty_like(op.query) if op.out is None else op.out


def unpacks(bundle: Callable[P, A]) -> Callable[[Callable[[A], R]], Callable[P, R]]:
    """Decorates an op implemented on its bundle: the result takes the bundle's fields
    (the signature of its constructor) and keeps the function's name and docstring."""

    def decorate(fn: Callable[[A], R]) -> Callable[P, R]:
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            return fn(bundle(*args, **kwargs))

        return _signed(call, fn, bundle, method=False)

    return decorate


def unpacks_method(
    bundle: Callable[P, A],
) -> Callable[[Callable[[S, A], R]], Callable[Concatenate[S, P], R]]:
    """`unpacks` for a method: self, then the bundle's fields."""

    def decorate(fn: Callable[[S, A], R]) -> Callable[Concatenate[S, P], R]:
        def call(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
            return fn(self, bundle(*args, **kwargs))

        return _signed(call, fn, bundle, method=True)

    return decorate


def _signed(call: Any, fn: Callable[..., Any], bundle: Callable[..., Any], method: bool) -> Any:
    """`call` named and documented as `fn`, with the bundle's fields as its signature
    (what `inspect.signature`, and through it `dispatch` and `cuda_ops`, read)."""
    for name in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(call, name, getattr(fn, name))
    fields = list(inspect.signature(bundle).parameters.values())
    if method:
        fields.insert(0, next(iter(inspect.signature(fn).parameters.values())))
    returns = inspect.signature(fn).return_annotation
    call.__signature__ = inspect.Signature(fields, return_annotation=returns)
    return call
