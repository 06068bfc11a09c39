"""CPU C kernels for the paged-attention ops and the linear layer, bound with ctypes
(the layer's element-wise ops, rotary with the KV write and RMSNorm, bind the same
library in `pdserve.kernels.cpu_layer_ops`).

Same signatures and semantics as `pdserve.kernels.reference` (the definition and the test
oracle). The C sources in `kernels/cpu/` take raw data pointers and element strides,
so strided views (the block-strided per-layer cache, q/k/v split out of a fused QKV
projection, `out` rows of a wider batch) need no copies. Every call uses
`torch.get_num_threads()` threads, the instance's share of the cores; the library
links the OpenMP runtime torch already loaded, so both share one thread pool.

    python -m pdserve.kernels.cpu_ops --build   # compile into the cache now (make install)

`pdserve.kernels.dispatch` calls `load` and `register` on the first CPU lookup (building the
library the first time) and keeps the torch references, with the reason logged once,
when that fails.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import struct
import sys

import torch

from pdserve.kernels import dispatch, lanes, reference
from pdserve.kernels.cpu_build import BuildError, BuiltLibrary, ensure_built
from pdserve.kernels.cpu_fields import (
    DTYPES,
    BoundCall,
    CallSink,
    RecordedCall,
    cache_fields,
    dtype_code,
    index_code,
    kv_scale_fields,
    linear_io,
    row_count,
    shaped_like,
    window_field,
)
from pdserve.kernels.op_args import (
    Attention,
    DecodeAttention,
    PrefillAttention,
    WriteKV,
    output,
    unpacks_method,
)
from pdserve.kernels.shapes import check_heads

Tensor = torch.Tensor

# Each entry point takes one struct of 8-byte fields (int64, one double for the scale)
# whose last field receives the index of a bad input; the field order is the C
# struct's (kernels/cpu/*.c), checked against its size at load time. One packed
# argument keeps a call at a few microseconds, where 35 ctypes arguments cost ~15.
_CALLS = {
    # key, value, cache, slots (pointer, dtype code, strides each), then shapes, threads;
    # k_scale, v_scale.
    "write": ("pd_write_kv_cache", struct.Struct("<25q2dq")),
    # query, cache, tables, lens, out, then shapes; scale; window, threads; k_scale,
    # v_scale (pd_attention_call).
    "decode": ("pd_decode_attention", struct.Struct("<30qd2q2dq")),
    # query_start_loc, num_tokens, then a decode call's fields.
    "prefill": ("pd_prefill_attention", struct.Struct("<4q30qd2q2dq")),
    # x, its row stride, weight, its dtype, its row stride, bias, bias dtype, y, its row
    # stride, then m, n, k, bf16 dot products (0/1), threads.
    "linear": ("pd_linear", struct.Struct("<15q")),
    # x, its row stride, weight packed with the outputs in the lanes (`kernels/lanes.py`),
    # bias, bias dtype, y, its row stride, then m, n, k, threads (kernels/cpu/linear_lanes.c).
    "linear_lanes": ("pd_linear_lanes", struct.Struct("<12q")),
    # x, its row stride, int8 weight, its row stride, scales, scales per row, bias, bias
    # dtype, y, its row stride, then m, n, k, threads (kernels/cpu/linear_int8.c).
    "linear_int8": ("pd_linear_int8", struct.Struct("<15q")),
    # x, its row stride, packed weight, its row stride (bytes), ggml type, bias, bias
    # dtype, y, its row stride, then m, n, k, bf16 dot products (0/1), threads
    # (kernels/cpu/linear_gguf.c).
    "linear_gguf": ("pd_linear_gguf", struct.Struct("<15q")),
    # packed weight, its row stride (bytes), ggml type, k, its rows, then ids (pointer,
    # index code, stride), their count, out (float32) and its row stride, bf16 values
    # (0/1) (kernels/cpu/linear_gguf.c).
    "gguf_rows": ("pd_gguf_rows", struct.Struct("<13q")),
    # qkv, positions, cos/sin (and its rows), q_out, cache, slots (pointer, dtype code,
    # strides each), then shapes, threads; k_scale, v_scale.
    "rotary": ("pd_rotary_write_kv_cache", struct.Struct("<29q2dq")),
    # x, residual, weight, out, residual out (pointer and row stride each, the weight's
    # pointer only), rows, n, threads; eps.
    "norm": ("pd_rms_norm", struct.Struct("<12qdq")),
    # gate/up, its row stride, out, its row stride, rows, n (the intermediate size),
    # threads (kernels/cpu/activation.c).
    "silu": ("pd_silu_and_mul", struct.Struct("<8q")),
    # the ops (entry and struct address each), their count (kernels/cpu/program.c).
    "program": ("pd_run_program", struct.Struct("<3q")),
}
# The attributes holding the bound calls the ops make (`recording` swaps them).
_OP_CALLS = (
    "write_call",
    "decode_call",
    "prefill_call",
    "linear_call",
    "lanes_call",
    "int8_call",
    "gguf_call",
    "gguf_rows_call",
    "rotary_call",
    "norm_call",
    "silu_call",
)
# Weight dtypes the C linear layer reads (float32 activations against either).
_LINEAR_WEIGHTS = (torch.float32, torch.bfloat16)


class CpuKernels:
    """The loaded library: one method per op, argument checks in Python, work in C."""

    def __init__(self, built: BuiltLibrary):
        self.path = built.path
        lib = ctypes.CDLL(str(built.path))
        calls = {op: BoundCall(lib, op, name, layout) for op, (name, layout) in _CALLS.items()}
        lib.pd_build_info.restype = ctypes.c_char_p
        self.build_info = lib.pd_build_info().decode()
        lib.pd_linear_bf16_dot_available.restype = ctypes.c_int
        # bf16 weights against bf16-rounded x where this build and CPU have AVX512-BF16
        # (see `linear`); `bf16_dot` is what calls use.
        self.bf16_dot_available = bool(lib.pd_linear_bf16_dot_available())
        self.bf16_dot = self.bf16_dot_available
        self.write_call = calls["write"]
        self.decode_call = calls["decode"]
        self.prefill_call = calls["prefill"]
        self.linear_call = calls["linear"]
        self.lanes_call = calls["linear_lanes"]
        self.int8_call = calls["linear_int8"]
        self.gguf_call = calls["linear_gguf"]
        self.gguf_rows_call = calls["gguf_rows"]
        self.rotary_call = calls["rotary"]
        self.norm_call = calls["norm"]
        self.silu_call = calls["silu"]
        self.program_call = calls["program"]

    def recording(self, sink: CallSink) -> CpuKernels:
        """These kernels with every op's call handed to `sink` (packed, not run): what a
        program of calls is recorded from (`cpu_program.py`), through the same argument
        checks and packing as a call made now."""
        view = copy.copy(self)
        for name in _OP_CALLS:
            setattr(view, name, RecordedCall(getattr(self, name), sink))
        return view

    def describe(self) -> str:
        linear = "bf16 dot-product" if self.bf16_dot else "float32"
        # Attention takes bf16 dot products wherever the CPU has them (attention.h).
        scores = "bf16 dot-product" if self.bf16_dot_available else "float32"
        return (
            f"C kernels ({self.build_info}; {linear} bf16 linear; {scores} bf16-cache scores; "
            f"{self.path.name})"
        )

    @unpacks_method(WriteKV)
    def write_kv_cache(self, op: WriteKV) -> None:
        key, value, kv_cache, slots = op.key, op.value, op.kv_cache, op.slot_mapping
        shape = key.shape
        cache = cache_fields(kv_cache, shape[-1])
        if len(shape) != 3 or shape[1] != cache[1] or value.shape != shape:
            raise ValueError(
                f"key/value must be [num_tokens, {cache[1]}, {shape[-1]}], got "
                f"{tuple(shape)} and {tuple(value.shape)}"
            )
        if slots.dim() != 1 or slots.shape[0] != shape[0]:
            raise ValueError(f"slot_mapping must be [{shape[0]}], got {tuple(slots.shape)}")
        k, v = key.stride(), value.stride()
        # One starred group a line, in the C struct's order: a tensor's fields (pointer,
        # dtype, strides), then the shapes and threads.
        self.write_call.run(
            *(key.data_ptr(), dtype_code("key", key), k[0], k[1], k[2]),
            *(value.data_ptr(), dtype_code("value", value), v[0], v[1], v[2]),
            *cache[3:],
            *(slots.data_ptr(), index_code("slot_mapping", slots), slots.stride(0)),
            *(shape[0], cache[1], cache[2], shape[2], cache[0], torch.get_num_threads()),
            *kv_scale_fields(kv_cache, op.k_scale, op.v_scale),
        )

    @unpacks_method(DecodeAttention)
    def decode_attention(self, op: DecodeAttention) -> Tensor:
        out = output(op)
        num_seqs = _query_shape(op.query, out)[0]
        if num_seqs == 0:
            return out
        self.decode_call.run(*_attention_fields(op, out, num_seqs))
        return out

    @unpacks_method(PrefillAttention)
    def prefill_attention(self, op: PrefillAttention) -> Tensor:
        out = output(op)
        num_tokens = _query_shape(op.query, out)[0]
        num_seqs = op.context_lens.shape[0]
        starts = op.query_start_loc
        if starts.dim() != 1 or starts.shape[0] != num_seqs + 1:
            raise ValueError(
                f"query_start_loc must be [{num_seqs + 1}] (num_seqs + 1), "
                f"got {tuple(starts.shape)}"
            )
        if num_seqs == 0:
            return out
        self.prefill_call.run(
            *(starts.data_ptr(), index_code("query_start_loc", starts), starts.stride(0)),
            num_tokens,
            *_attention_fields(op, out, num_seqs),
        )
        return out

    def linear(
        self, x: Tensor, weight: Tensor, bias: Tensor | None = None, out: Tensor | None = None
    ) -> Tensor:
        """`reference.linear_ref`; a float32 x against a float32 or bfloat16 weight runs
        in C at every row count (a bf16 weight read without widening it first), each
        row's output independent of the others (BLAS picks kernels by the row count,
        so a token's output would depend on what shares its step). With `bf16_dot`, a
        bf16 weight meets x rounded to bf16 (bf16 dot products, 2.5-3x the float32
        FMA path's throughput at prefill sizes); float32 weights always keep float32 x.
        `out`: float32 [rows, n] rows to write (a recorded program's buffer; x 2-D)."""
        rows = row_count(x)
        if (
            x.dtype != torch.float32
            or weight.dtype not in _LINEAR_WEIGHTS
            or rows == 0
            or weight.dim() != 2
            or weight.stride(1) != 1
            or not weight.is_cpu
        ):
            return reference.linear_ref(x, weight, bias)
        n, k = weight.shape
        x2, y, bias_ptr, bias_dt = linear_io("linear", x, rows, n, k, bias, out)
        self.linear_call.run(
            *(x2.data_ptr(), x2.stride(0), weight.data_ptr(), DTYPES[weight.dtype]),
            *(weight.stride(0), bias_ptr, bias_dt, y.data_ptr(), y.stride(0), rows, n, k),
            *(int(self.bf16_dot and weight.dtype == torch.bfloat16), torch.get_num_threads()),
        )
        return shaped_like(y, x)

    def linear_lanes(
        self,
        x: Tensor,
        packed: Tensor,
        n: int,
        bias: Tensor | None = None,
        out: Tensor | None = None,
    ) -> Tensor:
        """x @ W.T (+ bias) for a bf16 W[n, k] held in the lanes layout (`kernels/lanes.py`),
        x rounded to bf16 as `linear`'s bf16 dot products round it; AVX512-BF16 only (a
        ValueError elsewhere). Every row's output is independent of the others. With
        `bf16_dot` off, the float32 path of `linear` on the matrix unpacked."""
        k = x.shape[-1]
        if not self.bf16_dot:
            return self.linear(x, lanes.unpack(packed, n, k), bias, out)
        if x.dtype != torch.float32:
            raise ValueError(f"linear_lanes: x must be float32, got {x.dtype}")
        if tuple(packed.shape) != lanes.packed_shape(n, k) or packed.dtype != torch.bfloat16:
            raise ValueError(
                f"linear_lanes: a packed {packed.dtype} {list(packed.shape)} holds no [{n}, {k}]"
            )
        if not packed.is_contiguous() or not packed.is_cpu:
            raise ValueError("linear_lanes: the packed matrix must be contiguous, on CPU")
        rows = row_count(x)
        x2, y, bias_ptr, bias_dt = linear_io("linear_lanes", x, rows, n, k, bias, out)
        if rows:
            self.lanes_call.run(
                *(x2.data_ptr(), x2.stride(0), packed.data_ptr(), bias_ptr, bias_dt),
                *(y.data_ptr(), y.stride(0), rows, n, k, torch.get_num_threads()),
            )
        return shaped_like(y, x)


def _table_fields(num_seqs: int, block_tables: Tensor, context_lens: Tensor) -> tuple[int, ...]:
    """The C fields of block_tables (pointer, index type, 2 strides) and context_lens
    (pointer, index type, stride)."""
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be [{num_seqs}, max_blocks], got {tuple(block_tables.shape)}"
        )
    if context_lens.dim() != 1 or context_lens.shape[0] != num_seqs:
        raise ValueError(f"context_lens must be [{num_seqs}], got {tuple(context_lens.shape)}")
    t = block_tables.stride()
    tables = (block_tables.data_ptr(), index_code("block_tables", block_tables), t[0], t[1])
    lens = (
        context_lens.data_ptr(),
        index_code("context_lens", context_lens),
        context_lens.stride(0),
    )
    return (*tables, *lens)


def _attention_fields(op: Attention, out: Tensor, num_seqs: int) -> tuple[float, ...]:
    """The fields of a decode call (pd_attention_call in kernels/cpu/attention.h), after
    checking the inputs: the tensors and shapes, then the scale, window, threads and KV
    scales."""
    query, kv_cache, block_tables = op.query, op.kv_cache, op.block_tables
    num_heads, d = query.shape[1], query.shape[2]
    cache = cache_fields(kv_cache, d)
    check_heads(num_heads, cache[1])
    tables = _table_fields(num_seqs, block_tables, op.context_lens)
    q, o = query.stride(), out.stride()
    return (
        *(query.data_ptr(), dtype_code("query", query), q[0], q[1], q[2]),
        *cache[3:],
        *tables,
        *(out.data_ptr(), dtype_code("out", out), o[0], o[1], o[2]),
        *(num_seqs, num_heads, cache[1], cache[2], d, cache[0], block_tables.shape[1]),
        *(op.scale, window_field(op.sliding_window), torch.get_num_threads()),
        *kv_scale_fields(kv_cache, op.k_scale, op.v_scale),
    )


def _query_shape(query: Tensor, out: Tensor) -> tuple[int, int, int]:
    shape = query.shape
    if len(shape) != 3:
        raise ValueError(f"query must be [tokens, heads, head_dim], got {tuple(shape)}")
    if out.shape != shape:
        raise ValueError(f"out {tuple(out.shape)} must match query {tuple(shape)}")
    return shape


def load() -> CpuKernels:
    """Build if needed and load; raises BuildError (one line) when impossible."""
    try:
        return CpuKernels(ensure_built())
    except OSError as exc:  # a library that does not load (e.g. missing libgomp)
        raise BuildError(f"loading the CPU kernels failed: {exc}") from exc


def register(kernels: CpuKernels) -> None:
    dispatch.register_cpu("write_kv_cache", kernels.write_kv_cache)
    dispatch.register_cpu("decode_attention", kernels.decode_attention)
    dispatch.register_cpu("prefill_attention", kernels.prefill_attention)
    dispatch.register_cpu("linear", kernels.linear)
    dispatch.register_cpu("linear_lanes", kernels.linear_lanes)
    from pdserve.kernels.cpu_layer_ops import CpuLayerOps

    layer_ops = CpuLayerOps(kernels)
    dispatch.register_cpu("rotary_write_kv_cache", layer_ops.rotary_write_kv_cache)
    dispatch.register_cpu("rms_norm", layer_ops.rms_norm)
    dispatch.register_cpu("silu_and_mul", layer_ops.silu_and_mul)
    from pdserve.kernels.cpu_quantized import CpuQuantizedLinear

    quantized = CpuQuantizedLinear(kernels)
    dispatch.register_cpu("linear_int8", quantized.linear_int8)
    dispatch.register_cpu("linear_gguf", quantized.linear_gguf)
    dispatch.register_cpu("gguf_rows", quantized.gguf_rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the CPU attention kernels.")
    parser.add_argument("--build", action="store_true", help="compile into the cache now")
    args = parser.parse_args(argv)
    if not args.build:
        parser.print_help()
        return 0
    try:
        built = ensure_built()
        kernels = CpuKernels(built)
    except (BuildError, OSError) as exc:
        # Not fatal for an install: the engine then runs the torch references.
        print(f"CPU kernels not built: {exc}; CPU attention will use the torch references")
        return 0
    state = "built" if built.fresh else "up to date"
    print(f"CPU kernels {state}: {kernels.describe()} at {built.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
