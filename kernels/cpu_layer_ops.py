"""The CPU C kernels of a decoder layer's element-wise ops, bound with ctypes like
`pdserve.kernels.cpu_ops` (whose library they share): the query and key rotation with
the KV-cache write (kernels/cpu/rotary.c), RMSNorm with its residual add
(kernels/cpu/norm.c) and the MLP's silu-and-multiply (kernels/cpu/activation.c). Each
replaces a handful of torch ops (a few microseconds of dispatch each, ~60 norms and 30
rotations a decode step) by one call, with the same float32 values (the activation's
within a few ulps): `reference.py` defines them, the tests compare.
"""

from __future__ import annotations

import torch

from pdserve.kernels import reference
from pdserve.kernels.cpu_fields import (
    as_rows,
    cache_fields,
    dtype_code,
    index_code,
    kv_scale_fields,
    out_rows,
    row_count,
)
from pdserve.kernels.cpu_ops import CpuKernels
from pdserve.kernels.op_args import RotaryWriteKV, unpacks_method
from pdserve.kernels.shapes import check_heads

Tensor = torch.Tensor
# torch splits a row this long across threads, which changes its sum's order.
MAX_NORM_ROW = 32768


class CpuLayerOps:
    """The layer ops over the loaded library: argument checks in Python, work in C."""

    def __init__(self, kernels: CpuKernels):
        self.kernels = kernels

    @unpacks_method(RotaryWriteKV)
    def rotary_write_kv_cache(self, op: RotaryWriteKV) -> Tensor:
        """`reference.rotary_write_kv_cache_ref`: the rotated query comes back, the rotated
        keys and the values go to their slots; qkv's rows may be strided."""
        return self.rotary_into(op, None)

    def rotary_into(self, op: RotaryWriteKV, query: Tensor | None) -> Tensor:
        """`rotary_write_kv_cache` writing the rotated query into `query` (float32
        [num_tokens, num_heads, head_dim], any strides) where given."""
        positions, qkv, cos_sin_cache = op.positions, op.qkv, op.cos_sin_cache
        kv_cache, slot_mapping, num_heads = op.kv_cache, op.slot_mapping, op.num_heads
        d = kv_cache.shape[-1]
        cache = cache_fields(kv_cache, d)
        num_tokens, width = qkv.shape if qkv.dim() == 2 else (-1, -1)
        if width != (num_heads + 2 * cache[1]) * d or qkv.stride(1) != 1:
            raise ValueError(
                f"qkv must be [num_tokens, {(num_heads + 2 * cache[1]) * d}] with contiguous "
                f"columns, got {tuple(qkv.shape)}"
            )
        check_heads(num_heads, cache[1])
        for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
            if t.shape != (num_tokens,) or t.stride(0) != 1:
                raise ValueError(f"{name} must be [{num_tokens}] and contiguous")
        if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != d or cos_sin_cache.stride(1) != 1:
            raise ValueError(f"cos_sin_cache must be [max_position, {d}] with contiguous rows")
        if query is None:
            query = torch.empty(num_tokens, num_heads, d, dtype=qkv.dtype)
        elif query.shape != (num_tokens, num_heads, d) or query.dtype != qkv.dtype:
            raise ValueError(f"query must be [{num_tokens}, {num_heads}, {d}] of {qkv.dtype}")
        q = query.stride()
        self.kernels.rotary_call.run(
            *(qkv.data_ptr(), dtype_code("qkv", qkv), qkv.stride(0)),
            *(positions.data_ptr(), index_code("positions", positions)),
            *(cos_sin_cache.data_ptr(), dtype_code("cos_sin_cache", cos_sin_cache)),
            *(cos_sin_cache.stride(0), cos_sin_cache.shape[0]),
            *(query.data_ptr(), dtype_code("query", query), q[0], q[1], q[2]),
            *cache[3:],
            *(slot_mapping.data_ptr(), index_code("slot_mapping", slot_mapping)),
            *(num_tokens, num_heads, cache[1], d, cache[2], cache[0]),
            torch.get_num_threads(),
            *kv_scale_fields(kv_cache, op.k_scale, op.v_scale),
        )
        return query

    def rms_norm(
        self,
        x: Tensor,
        weight: Tensor,
        eps: float,
        residual: Tensor | None = None,
        out: Tensor | None = None,
        summed: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """`reference.rms_norm_ref` on float32 rows of 8 to 32767 elements (what a CPU
        model computes in); anything else runs the reference. `out` and `summed` (the
        residual's sum; it may be `residual` itself): rows to write where given."""
        n = x.shape[-1] if x.dim() else 0
        rows = row_count(x)
        if (
            x.dtype != torch.float32
            or weight.dtype != torch.float32
            or not 8 <= n < MAX_NORM_ROW
            or rows == 0
            or weight.shape != (n,)
            or weight.stride(0) != 1
            or (residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape))
        ):
            return reference.rms_norm_ref(x, weight, eps, residual)
        x2 = as_rows(x, rows, n)
        out = torch.empty(x.shape, dtype=torch.float32) if out is None else out
        o2 = out_rows("rms_norm", out, tuple(x.shape))
        if residual is None:
            r2 = summed = s2 = None
        else:
            r2 = as_rows(residual, rows, n)
            summed = torch.empty(x.shape, dtype=torch.float32) if summed is None else summed
            s2 = out_rows("rms_norm", summed, tuple(x.shape))
        self.kernels.norm_call.run(
            *(x2.data_ptr(), x2.stride(0)),
            *((0, 0) if r2 is None else (r2.data_ptr(), r2.stride(0))),
            *(weight.data_ptr(), o2.data_ptr(), o2.stride(0)),
            *((0, 0) if s2 is None else (s2.data_ptr(), s2.stride(0))),
            *(rows, n, torch.get_num_threads(), float(eps)),
        )
        return out if summed is None else (out, summed)

    def silu_and_mul(self, gate_up: Tensor, out: Tensor | None = None) -> Tensor:
        """`reference.silu_and_mul_ref` on float32 rows (within a few ulps: see
        kernels/cpu/activation.c); anything else runs the reference. `out`: rows to
        write where given."""
        width = gate_up.shape[-1] if gate_up.dim() else 0
        rows = row_count(gate_up)
        if gate_up.dtype != torch.float32 or rows == 0 or width % 2:
            return reference.silu_and_mul_ref(gate_up)
        x2 = as_rows(gate_up, rows, width)
        n = width // 2
        shape = (*gate_up.shape[:-1], n)
        out = torch.empty(shape, dtype=torch.float32) if out is None else out
        out2 = out_rows("silu_and_mul", out, shape)
        self.kernels.silu_call.run(
            *(x2.data_ptr(), x2.stride(0), out2.data_ptr(), out2.stride(0)),
            *(rows, n, torch.get_num_threads()),
        )
        return out
