"""The C kernels' calling conventions on the Python side: dtype and index codes, the
binding of an entry point's packed argument struct, its error codes, and the fields
every binding (`cpu_ops`, `cpu_layer_ops`, `cpu_quantized`) passes alike."""

from __future__ import annotations

import ctypes
import struct
from typing import Protocol

import torch

from pdserve.kernels.cpu_build import BuildError
from pdserve.kernels.shapes import check_kv_layout, check_kv_scales

Tensor = torch.Tensor

DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# A KV cache may also hold FP8 (kernels/cpu/common.h: DT_E4M3, DT_E5M2).
CACHE_DTYPES = {**DTYPES, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
_INDEX = {torch.int32: 0, torch.int64: 1}
_ERRORS = {
    -1: "slot_mapping[{i}] points past the KV cache's last block",
    -2: "context_lens[{i}] is negative or longer than its block table row holds",
    -3: "block_tables row {i} names a block outside the KV cache",
    -4: "query_start_loc must be non-decreasing and within the query rows (sequence {i})",
    -5: "sequence {i} has more new tokens than its context_len",
    -6: "out of memory in a CPU attention kernel",
    -7: "positions[{i}] is outside the cos/sin cache",
    -8: "head_dim must be even and at most 1024 for the rotary kernel",
    -9: "this build of the CPU kernels (or this CPU) has no bf16 dot-product linear layer",
    -10: "linear_int8: the scale groups do not split the weight rows into whole vectors",
    -11: "gguf_rows: ids[{i}] is outside the matrix's rows",
}


class BoundCall:
    """One entry point of the library: it takes one struct of 8-byte fields laid out as
    `layout` (its size checked against the library's `pd_<op>_call_size()`), whose last
    field receives the index of a bad input."""

    __slots__ = ("_args", "_pack", "_run", "address")

    def __init__(self, lib: ctypes.CDLL, op: str, name: str, layout: struct.Struct):
        size_fn = getattr(lib, f"pd_{op}_call_size")
        size_fn.restype = ctypes.c_int64
        if size_fn() != layout.size:
            raise BuildError(f"{name} takes {size_fn()} bytes of arguments, not {layout.size}")
        self._run = getattr(lib, name)
        self._run.argtypes = [ctypes.POINTER(ctypes.c_int64)]
        self._run.restype = ctypes.c_int
        # The entry point's address, for a program of calls (kernels/cpu/program.c).
        self.address = ctypes.cast(self._run, ctypes.c_void_p).value or 0
        self._pack = layout.pack_into
        self._args = ctypes.c_int64 * (layout.size // 8)

    def pack(self, *fields: float) -> ctypes.Array[ctypes.c_int64]:
        """The argument struct of a call: the fields (all but the bad-input slot) in the
        struct's order."""
        args = self._args()
        self._pack(args, 0, *fields, -1)
        return args

    def run(self, *fields: float) -> None:
        """Packs the fields and calls; a non-zero return becomes a one-line ValueError
        naming the bad input."""
        self.call(self.pack(*fields))

    def call(self, args: ctypes.Array[ctypes.c_int64]) -> None:
        """Calls on a packed struct (`pack`), raising as `run` does."""
        rc = self.invoke(args)
        if rc:
            raise ValueError(error_message(rc, args[-1]))

    def invoke(self, args: ctypes.Array[ctypes.c_int64]) -> int:
        """Calls on a packed struct and returns the entry point's code (0: done)."""
        return int(self._run(args))


class CallSink(Protocol):
    """Where a recorded call's packed struct goes (`cpu_program.CpuProgram`)."""

    def append(self, call: BoundCall, args: ctypes.Array[ctypes.c_int64]) -> None: ...


class RecordedCall:
    """A BoundCall's stand-in while a program is recorded: `run` packs the struct as the
    call would and hands it to the sink instead of calling."""

    __slots__ = ("_bound", "_sink")

    def __init__(self, bound: BoundCall, sink: CallSink):
        self._bound = bound
        self._sink = sink

    def run(self, *fields: float) -> None:
        self._sink.append(self._bound, self._bound.pack(*fields))


def error_message(rc: int, bad: int) -> str:
    """The one line of a kernel's error code `rc`, naming the bad input's index."""
    return _ERRORS.get(rc, f"CPU kernel failed with code {rc}").format(i=bad)


def dtype_code(name: str, t: Tensor) -> int:
    code = DTYPES.get(t.dtype)
    if code is None:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    return code


def index_code(name: str, t: Tensor) -> int:
    code = _INDEX.get(t.dtype)
    if code is None:
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    return code


def window_field(sliding_window: int | None) -> int:
    if sliding_window is None:
        return 0
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
    return int(sliding_window)


def cache_fields(kv_cache: Tensor, head_dim: int) -> tuple[int, ...]:
    """(num_blocks, kv_heads, block_size, then the C fields: pointer, dtype, 4 strides)."""
    check_kv_layout(kv_cache, None, head_dim)
    shape = kv_cache.shape
    c = kv_cache.stride()
    if c[4] != 1 and head_dim > 1:
        raise ValueError("kv_cache must be contiguous along head_dim (the KV layout contract)")
    if not kv_cache.is_cpu:
        raise ValueError(f"kv_cache must be on the CPU, got {kv_cache.device}")
    code = CACHE_DTYPES.get(kv_cache.dtype)
    if code is None:
        raise TypeError(
            f"kv_cache must be float32, bfloat16, float16, float8_e4m3fn or float8_e5m2, "
            f"got {kv_cache.dtype}"
        )
    return shape[0], shape[2], shape[3], kv_cache.data_ptr(), code, c[0], c[1], c[2], c[3]


def kv_scale_fields(kv_cache: Tensor, k_scale: float, v_scale: float) -> tuple[float, float]:
    """The scale fields, once `check_kv_scales` accepts them."""
    check_kv_scales(kv_cache, k_scale, v_scale)
    return float(k_scale), float(v_scale)


def row_count(x: Tensor) -> int:
    """x's rows as a matrix of its last dimension (0 for an empty or 0-d x)."""
    return x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0


def linear_io(
    op: str, x: Tensor, rows: int, n: int, k: int, bias: Tensor | None, out: Tensor | None = None
) -> tuple[Tensor, Tensor, int, int]:
    """What every C linear layer checks and passes alike, in one call (a decode step makes
    ~120): x's features and the bias checked; x as [rows, k] with contiguous columns, the
    float32 output [rows, n] to fill (`out`, rows of any stride, where given), and the
    bias's C fields (pointer, dtype; 0, -1: none)."""
    if x.shape[-1] != k:
        raise ValueError(f"{op}: x has {x.shape[-1]} features, weight expects {k}")
    if bias is None:
        bias_ptr, bias_dt = 0, -1
    elif bias.shape != (n,) or not bias.is_contiguous():
        raise ValueError(f"{op}: bias must be [{n}] and contiguous, got {tuple(bias.shape)}")
    else:
        bias_ptr, bias_dt = bias.data_ptr(), dtype_code("bias", bias)
    y = torch.empty(rows, n, dtype=torch.float32) if out is None else out_rows(op, out, (rows, n))
    return as_rows(x, rows, k), y, bias_ptr, bias_dt


def out_rows(op: str, out: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A caller's output of `shape`, as the rows [-1, shape[-1]] the kernel writes (a view:
    the rows must be evenly strided, as a prefix of a bigger buffer's rows is)."""
    n = shape[-1]
    if out.dtype != torch.float32 or tuple(out.shape) != tuple(shape) or out.stride(-1) != 1:
        raise ValueError(
            f"{op}: out must be float32 {list(shape)} with contiguous columns, got "
            f"{out.dtype} {list(out.shape)}"
        )
    try:
        return out.view(-1, n)
    except RuntimeError:
        raise ValueError(f"{op}: out's rows must be evenly strided") from None


def as_rows(t: Tensor, rows: int, n: int) -> Tensor:
    """t as [rows, n] with contiguous columns (a view where it can be)."""
    t2 = t if t.dim() == 2 else t.reshape(rows, n)
    return t2 if t2.stride(1) == 1 else t2.contiguous()


def shaped_like(y: Tensor, x: Tensor) -> Tensor:
    """A linear layer's output rows [rows, n] shaped as x's leading dimensions by n."""
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[1])
