"""Engine arguments: what `LLM(...)`, an instance and the CLI flags configure.

Torch-free (dtypes by name), so a driver builds and checks them without loading torch.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")
# Weight quantizations applied at load to a 16/32-bit checkpoint (vLLM's spelling).
QUANTIZATIONS = ("int8",)
# The KV cache's dtype (vLLM's spelling): auto the model's dtype; fp8 is fp8_e4m3.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
_FP8_TORCH_NAMES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
GiB = 1 << 30


def default_block_size(device: str) -> int:
    """Tokens per KV block where none is asked for. On CPU 32: the C attention kernels
    take a block's keys in tiles of up to 32 from its start, and a 16-token block halves
    every tile (its softmax bookkeeping and reads of the accumulators, paid per tile). On
    CUDA 16, the Triton kernels' block."""
    return 32 if device == "cpu" else 16


class EngineConfig(msgspec.Struct, kw_only=True):
    """Checked once, where it is made (and again where it is decoded, after crossing a
    process seam inside an `InstanceSpec`)."""

    model: str | None = None  # a Hugging Face checkpoint folder; None: the embedded model
    tokenizer: str | None = None  # its tokenizer's folder (for grammars); None: the model's
    # Sampling defaults: "auto" the checkpoint's generation_config.json, "vllm" none
    # (SamplingParams' own), or a folder holding another generation_config.json.
    generation_config: str = "auto"
    # auto: the checkpoint's dtype; on CPU float16 → bfloat16, and float32 → bfloat16
    # where the CPU has bf16 dot products (`dtype_name`).
    dtype: str = "auto"
    # None: weights in `dtype`; "int8": the decoder layers' matrices as int8 with one scale
    # per group of 16 inputs, quantized at load (engine/models/int8.py; CPU only).
    quantization: str | None = None
    # auto: the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2: one byte an element, with one
    # k_scale and one v_scale per layer (the checkpoint's, else 1; CPU only).
    kv_cache_dtype: str = "auto"
    # An FP8 cache's scales measured at load on a calibration text (engine/kv_calibration.py)
    # instead of the checkpoint's (vLLM's `calculate_kv_scales`).
    calculate_kv_scales: bool = False
    block_size: int = 0  # 0: default_block_size(device)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    kv_cache_memory: int = 2 * GiB  # bytes of KV cache on CPU
    num_kv_blocks: int | None = None  # overrides kv_cache_memory (tests force small pools)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Admission order of waiting requests: "fcfs" (arrival) or "lpm" (longest cached prefix first).
    scheduling_policy: str = "fcfs"
    seed: int = 0
    num_threads: int | None = None  # torch threads; None: all cores
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    gpu_memory_utilization: float = 0.9  # CUDA: share of the device's memory this engine may use
    # Decode steps eagerly: no CUDA graphs, and on CPU no recorded programs (cpu_decode.py).
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] | None = None  # decode batch sizes to capture; None: defaults
    # Ranks of a tensor-parallel worker group (one process each; 1: in the driver's process).
    tensor_parallel_size: int = 1
    # Pipeline stages, each a contiguous layer range on tensor_parallel_size ranks of its own.
    pipeline_parallel_size: int = 1
    # A structured-output grammar that takes longer to compile fails its request.
    grammar_compile_timeout_s: float = 30.0
    # Times the model per step and charges each request the steps it was part of
    # (`InstanceTimings.prefill_model`, `decode_model`): `--collect-detailed-traces model`.
    collect_model_time: bool = False

    def __post_init__(self) -> None:
        if self.block_size == 0:
            self.block_size = default_block_size(self.device)
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        self._check_quantization()
        self._check_kv_cache_dtype()
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "tensor_parallel_size",
            "pipeline_parallel_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", self.device):
            raise ValueError(f"device must be cpu, cuda or cuda:N; got {self.device!r}")
        if self.cuda_graph_sizes is not None and any(s < 1 for s in self.cuda_graph_sizes):
            raise ValueError(f"cuda_graph_sizes must be positive, got {self.cuda_graph_sizes}")

    def _check_quantization(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}"
            )
        if self.quantization is not None and self.device != "cpu":
            raise ValueError(
                f"quantization {self.quantization} runs on CPU (its C kernels); "
                f"it is not built for device {self.device}"
            )

    def _check_kv_cache_dtype(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.kv_cache_dtype != "auto" and self.device != "cpu":
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype} runs on CPU (its C kernels); the CUDA "
                f"kernels have no FP8 KV cache (device {self.device}): use auto there"
            )
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError(
                "calculate_kv_scales sets an FP8 KV cache's scales: it needs kv_cache_dtype "
                "fp8, fp8_e4m3 or fp8_e5m2"
            )
        if self.calculate_kv_scales and self.pipeline_parallel_size > 1:
            raise ValueError(
                "calculate_kv_scales runs the whole model on a calibration text; it is not "
                "built for pipeline stages (pipeline_parallel_size > 1)"
            )

    def kv_dtype_name(self, model_dtype: str) -> str:
        """The KV cache's torch dtype name for a model computing in `model_dtype`."""
        return _FP8_TORCH_NAMES.get(self.kv_cache_dtype, model_dtype)

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        known = set(cls.__struct_fields__)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def dtype_name(self, checkpoint_dtype: str | None) -> str:
        if self.dtype != "auto":
            return self.dtype
        name = checkpoint_dtype if checkpoint_dtype in DTYPES else "float32"
        if self.device != "cpu":
            return name
        from pdserve.kernels.cpu_build import native_bf16

        # CPUs have no fast float16 path; bfloat16 keeps the range of float32. With bf16
        # dot products a float32 checkpoint runs 1.7x faster in bfloat16, its greedy
        # output within the accuracy of its source (`pdserve eval compare`, BENCHMARKS).
        if name == "float16" or (name == "float32" and native_bf16()):
            return "bfloat16"
        return name

    def torch_dtype(self, checkpoint_dtype: str | None) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype_name(checkpoint_dtype))

    @property
    def world_size(self) -> int:
        """The ranks of the executor: tensor_parallel_size per pipeline stage."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def resolved_threads(self) -> int:
        return self.num_threads or max(1, os.cpu_count() or 1)
