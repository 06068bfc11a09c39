"""Device check, one command on a CUDA machine: `python -m bench.gpu_check`.

1. kernels: every Triton kernel against its torch reference; decode-attention
   bandwidth and prefill-attention TFLOP/s tables (`bench.gpu_kernels`).
2. engine: greedy tokens with Triton kernels equal to the reference path on a small
   model, and the 8B-shaped decode step with CUDA graphs beside transformers'
   `generate` (sections below, filled in by the engine's GPU path).

Runs with the machine's own Python, torch and triton: it imports only torch and the
repository's `kernels` (no other project dependency). Exits 1 with one line when no
CUDA device is present, and 1 when a correctness check fails.
"""

from __future__ import annotations

import sys
import time


def require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(
            "gpu_check: no CUDA device available (torch.cuda.is_available() is False); "
            "run it on a GPU machine"
        )


def run_kernel_section() -> bool:
    from bench import gpu_kernels

    ok = gpu_kernels.check_all_kernels()
    gpu_kernels.bench_decode_bandwidth()
    gpu_kernels.bench_prefill_throughput()
    return ok


def run_engine_greedy_check() -> bool:
    """Engine section (to be added with the engine's CUDA path): greedy tokens of a
    small model with the Triton kernels equal those of the reference kernels
    (`kernels.dispatch.set_triton_enabled(False)` routes CUDA to the references)."""
    print("\nEngine greedy tokens, Triton vs reference: not wired in yet (engine CUDA path)")
    return True


def run_engine_decode_step_bench() -> None:
    """Engine section (to be added with the engine's CUDA path): 8B-shaped decode step
    time with CUDA graphs at batch 1/16/64, 1k context, beside transformers' generate."""
    print("8B decode step with CUDA graphs vs transformers: not wired in yet (engine CUDA path)")


def main() -> int:
    require_cuda()
    import torch

    start = time.perf_counter()
    print(f"gpu_check on {torch.cuda.get_device_name(0)}, torch {torch.__version__}", end="")
    import triton

    print(f", triton {triton.__version__}, python {sys.version.split()[0]}\n")
    ok = run_kernel_section()
    ok = run_engine_greedy_check() and ok
    run_engine_decode_step_bench()
    print(f"\ngpu_check {'passed' if ok else 'FAILED'} in {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
