"""Compile every Triton kernel for Hopper (sm_90) without a GPU.

Run as `python -m tests.kernels.hopper_compile` with TRITON_INTERPRET unset. The
public wrappers are called on small CPU tensors of deployment shapes with each
kernel replaced by a recorder, so the compiled variants are exactly the launches a
CUDA call would make (same constexprs, specialisations, warps and stages; the launch
heuristics see an H200's 132 SMs). Each recorded launch then goes through
`triton.compile` down to a cubin (ptxas included) and must fit Hopper's shared memory.
Prints one line per variant; exits non-zero on the first failure.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget

from pdserve.kernels import (
    triton_decode,
    triton_kv_write,
    triton_norm,
    triton_prefill,
    triton_rotary,
)

HOPPER = GPUTarget("cuda", 90, 32)
H200_SMS = 132
MAX_SHARED_BYTES = 227 * 1024  # opt-in shared memory per block on sm_90
_TYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
}


@dataclass
class Launch:
    kernel: Any
    args: tuple
    kwargs: dict
    label: str = ""

    def source(self) -> tuple[triton.compiler.ASTSource, dict]:
        """The ASTSource the runtime would build for this launch, and its options."""
        options = {k: v for k, v in self.kwargs.items() if k in ("num_warps", "num_stages")}
        values = dict(zip(self.kernel.arg_names, self.args, strict=False))
        values.update({k: v for k, v in self.kwargs.items() if k not in options})
        signature, constexprs, attrs = {}, {}, {}
        for index, param in enumerate(self.kernel.params):
            value = values[param.name]
            if param.is_constexpr:
                signature[param.name] = "constexpr"
                constexprs[param.name] = value
            elif isinstance(value, torch.Tensor):
                signature[param.name] = "*" + _TYPES[value.dtype]
                attrs[(index,)] = [["tt.divisibility", 16]]  # CUDA allocations are aligned
            elif isinstance(value, bool):
                signature[param.name] = "i1"
            elif isinstance(value, int):
                if value == 1:  # the runtime folds unit strides into the kernel
                    signature[param.name] = "constexpr"
                    constexprs[param.name] = 1
                    continue
                signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
                if value % 16 == 0:
                    attrs[(index,)] = [["tt.divisibility", 16]]
            elif isinstance(value, float):
                signature[param.name] = "fp32"
            else:
                raise TypeError(f"{param.name}: cannot type {value!r}")
        return triton.compiler.ASTSource(self.kernel, signature, constexprs, attrs), options


@dataclass
class Recorder:
    kernel: Any
    launches: list[Launch] = field(default_factory=list)
    label: str = ""

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.launches.append(Launch(self.kernel, args, kwargs, self.label))

        return record


def _paged(num_kv_heads, head_dim, block_size, dtype, width, num_seqs):
    storage = torch.zeros(4, 2, 2, num_kv_heads, block_size, head_dim, dtype=dtype)
    tables = torch.zeros(num_seqs, width, dtype=torch.int32)
    lens = torch.full((num_seqs,), block_size * width, dtype=torch.int32)
    return storage[:, 1], tables, lens


def record_launches() -> list[Launch]:
    """Deployment-shaped calls of every wrapper, covering each kernel variant."""
    modules = [triton_kv_write, triton_decode, triton_prefill, triton_norm, triton_rotary]
    recorders: dict[str, Recorder] = {}
    saved = []
    for module in modules:
        for name in dir(module):
            obj = getattr(module, name)
            if isinstance(obj, triton.runtime.JITFunction) and name.endswith("_kernel"):
                recorders[name] = Recorder(obj)
                saved.append((module, name, obj))
                setattr(module, name, recorders[name])
        for name, value in (("upcast_dot", lambda *_: False), ("num_sms", lambda _: H200_SMS)):
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, value)
    try:
        _call_wrappers(recorders)
    finally:
        for module, name, obj in saved:
            setattr(module, name, obj)
    return [launch for rec in recorders.values() for launch in rec.launches]


def _label(recorders: dict[str, Recorder], text: str) -> None:
    for rec in recorders.values():
        rec.label = text


def _call_wrappers(recorders: dict[str, Recorder]) -> None:
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    # Decode: the 8B shape both ways (single pass / split-K), every head_dim and dtype.
    for heads, kvh, d, bs, dtype, window, seqs, width in [
        (32, 8, 128, 16, bf16, None, 128, 64),  # many sequences: single pass
        (32, 8, 128, 16, bf16, None, 1, 1024),  # one long sequence: split-K
        (9, 3, 64, 16, f16, 4096, 2, 512),
        (8, 1, 64, 32, f32, None, 1, 64),
        (4, 2, 256, 16, f16, None, 96, 8),
    ]:
        _label(recorders, f"decode h{heads}/{kvh} d{d} bs{bs} {_TYPES[dtype]} w{window}")
        cache, tables, lens = _paged(kvh, d, bs, dtype, width, seqs)
        query = torch.zeros(seqs, heads, d, dtype=dtype)
        triton_decode.decode_attention_triton(query, cache, tables, lens, d**-0.5, window)
    # Prefill: every head_dim and dtype, with and without a window.
    for heads, kvh, d, bs, dtype, window in [
        (32, 8, 128, 16, bf16, None),
        (9, 3, 64, 16, bf16, 512),
        (8, 2, 256, 32, bf16, None),
        (8, 1, 128, 32, f16, 100),
        (8, 8, 64, 32, f32, None),
    ]:
        _label(recorders, f"prefill h{heads}/{kvh} d{d} bs{bs} {_TYPES[dtype]} w{window}")
        cache, tables, lens = _paged(kvh, d, bs, dtype, 2, 2)
        query = torch.zeros(40, heads, d, dtype=dtype)
        starts = torch.tensor([0, 8, 40], dtype=torch.int32)
        triton_prefill.prefill_attention_triton(query, cache, tables, starts, lens, d**-0.5, window)
    # KV write, from a fused QKV projection.
    for kvh, d, bs, dtype in [(8, 128, 16, bf16), (2, 256, 32, f32)]:
        _label(recorders, f"kv write kv{kvh} d{d} bs{bs} {_TYPES[dtype]}")
        cache, _, _ = _paged(kvh, d, bs, dtype, 1, 1)
        qkv = torch.zeros(3, 4 * kvh, d, dtype=dtype)
        slots = torch.zeros(3, dtype=torch.int64)
        triton_kv_write.write_kv_cache_triton(qkv[:, :kvh], qkv[:, kvh : 2 * kvh], cache, slots)
    # RMSNorm: the 8B hidden with residual, SmolLM's with an fp32 weight, a q/k norm.
    for shape, dtype, wdtype, residual in [
        ((4, 4096), bf16, bf16, True),
        ((4, 576), bf16, f32, False),
        ((4, 8, 128), f16, f16, False),
    ]:
        _label(recorders, f"rms_norm {shape} {_TYPES[dtype]} residual={residual}")
        x = torch.zeros(shape, dtype=dtype)
        res = torch.zeros(shape, dtype=dtype) if residual else None
        triton_norm.rms_norm_triton(x, torch.ones(shape[-1], dtype=wdtype), 1e-5, res)
    # Rotary on views of a fused QKV projection.
    for heads, kvh, d, dtype in [(32, 8, 128, bf16), (9, 3, 64, f32)]:
        _label(recorders, f"rotary h{heads}/{kvh} d{d} {_TYPES[dtype]}")
        qkv = torch.zeros(3, heads + 2 * kvh, d, dtype=dtype)
        cos_sin = torch.zeros(64, d, dtype=torch.float32)
        positions = torch.zeros(3, dtype=torch.int64)
        triton_rotary.rotary_embedding_triton(
            positions, qkv[:, :heads], qkv[:, heads : heads + kvh], cos_sin
        )


def compile_all() -> int:
    launches = record_launches()
    kernels_seen = {launch.kernel.__name__ for launch in launches}
    failures = 0
    for launch in launches:
        src, options = launch.source()
        start = time.perf_counter()
        try:
            compiled = triton.compile(src, target=HOPPER, options=options)
        except Exception as exc:  # report every broken variant, then fail
            failures += 1
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            print(f"FAIL {launch.kernel.__name__} [{launch.label}]: {first}")
            continue
        shared = compiled.metadata.shared
        ok = bool(compiled.asm.get("cubin")) and shared <= MAX_SHARED_BYTES
        failures += not ok
        print(
            f"{'ok  ' if ok else 'FAIL'} {launch.kernel.__name__} [{launch.label}] "
            f"warps={options.get('num_warps')} stages={options.get('num_stages')} "
            f"shared={shared}B {time.perf_counter() - start:.1f}s"
        )
    passed = len(launches) - failures
    print(f"compiled {passed}/{len(launches)} variants of {len(kernels_seen)} kernels")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(compile_all())
