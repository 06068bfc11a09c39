"""kernels: the model's arithmetic: paged attention, the linear layer and fused ops.

- Triton kernels for CUDA, called as torch operators (`cuda_ops.py`), each with a fake
  implementation that checks shapes, dtypes and devices, so the CUDA path runs on fake
  `cuda` tensors in the tests (`tests/engine/test_fake_cuda.py`). Importing `kernels`
  never imports triton: CUDA calls load the Triton kernels on first use
  (`load_triton_kernels`), and where triton is missing they run the references and
  `triton_unavailable_reason()` says why.
- C kernels for CPU, built on first use for this CPU, or for AVX2 under
  `PDSERVE_CPU_ISA=avx2` (`cpu_build.py`, checked here; `cpu_ops.py` loads them, every
  binding passes its arguments by `cpu_fields.py`'s conventions): one
  attention arithmetic for decode and prefill (`cpu/attend.h`); the query and key
  rotation with the KV-cache write, straight from the fused QKV projection, one call
  per layer (`cpu/rotary.c`); RMSNorm with its residual add (`cpu/norm.c`), summing in
  torch's order so float32 values stay the reference's; the MLP's silu-and-multiply
  (`cpu/activation.c`); a program of recorded calls run as one (`cpu_program.py`,
  `cpu/program.c`: a decode step's forward); the linear layer at every row
  count (`cpu/linear.c`, `cpu/linear_bf16.c`; `cpu/linear_lanes.c` for a bf16 matrix
  packed at load with its outputs in the vector lanes, `lanes.py`), and its weight-only int8 form
  (`cpu/linear_int8.c`, bound in `cpu_quantized.py`: int8 rows widened in registers, times
  one scale per group of inputs), and the GGUF block formats Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the
  K-quants Q4_K, Q5_K, Q6_K kept packed with their scales, and rows of such a matrix for
  an embedding table kept in its blocks (`cpu/linear_gguf.c`, `cpu/linear_kquant.c`,
  bound there too; `gguf_blocks.py` their sizes, dequantization
  and reference, `gguf_kquants.py` the K-quants' dequantization). A KV cache may hold
  FP8 (e4m3 or e5m2, one scale per layer's keys and values): the write quantizes,
  attention widens through float16 bits (`cpu/common.h`). `cpu_kernels_status()` says which
  implementation is active.
- Plain-torch references of the same signatures (`reference.py`), and the dispatch
  between them (`dispatch.py`, `ops.py`, `attention.py`). The paged-cache ops' signatures
  are their argument bundles (`op_args.py`), which every implementation takes whole.
"""

from pdserve.kernels.attention import (
    AttentionMetadata,
    attend_cached,
    decode_attention,
    kv_scale_args,
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
from pdserve.kernels.ops import (
    gguf_rows,
    linear,
    linear_gguf,
    linear_int8,
    linear_lanes,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
)

apply_isa()  # before torch's first vectorised op, which reads the capability once

__all__ = [
    "AttentionMetadata",
    "attend_cached",
    "cpu_kernels_status",
    "decode_attention",
    "gguf_rows",
    "kv_scale_args",
    "linear",
    "linear_gguf",
    "linear_int8",
    "linear_lanes",
    "load_triton_kernels",
    "paged_attention",
    "prefill_attention",
    "rms_norm",
    "silu_and_mul",
    "rotary_embedding",
    "rotary_write_kv_cache",
    "triton_unavailable_reason",
    "write_kv_cache",
]
