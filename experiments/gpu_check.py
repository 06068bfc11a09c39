"""Device check, one command on a CUDA machine: `python -m experiments.gpu_check`.

1. kernels: every Triton kernel against its torch reference; decode-attention
   bandwidth and prefill-attention TFLOP/s tables (`experiments.gpu_kernels`).
2. engine (`experiments.gpu_engine`): greedy tokens with Triton kernels and CUDA graphs
   equal to the reference path on a small fp32 model; the 8B-shaped decode step from
   CUDA graphs at batch 1/16/64 and 1k context beside transformers' `generate` on the
   same random model (`experiments.gpu_transformers`, skipped when transformers is absent);
   the prefill of a 4096-token prompt.

Runs with the machine's own Python, torch and triton: it imports only torch, the
repository's `kernels` and the scheduler-free parts of `engine` (no msgspec, zmq, ray,
ucxx or fastapi). Exits 1 with one line when no CUDA device is present, and 1 when a
correctness check fails or a section raises. `--dry-run-cpu` runs the engine sections
on CPU with tiny shapes instead (CI's proof that they execute).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable


def require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(
            "gpu_check: no CUDA device available (torch.cuda.is_available() is False); "
            "run it on a GPU machine"
        )


def run_kernel_section() -> bool:
    from experiments import gpu_kernels

    ok = gpu_kernels.check_all_kernels()
    gpu_kernels.bench_decode_bandwidth()
    gpu_kernels.bench_prefill_throughput()
    return ok


def run_engine_greedy_check(device, dry_run: bool = False) -> bool:
    """Greedy tokens of a small fp32 model with the Triton kernels (decode steps from
    CUDA graphs) equal those of the torch references (`experiments.gpu_engine`)."""
    from experiments import gpu_engine

    print("\nEngine greedy tokens, Triton kernels + CUDA graphs vs torch references:")
    return gpu_engine.run_greedy_check(device, dry_run)


def run_engine_decode_step_bench(device, dry_run: bool = False) -> None:
    """8B-shaped decode step with CUDA graphs at batch 1/16/64, 1k context, beside
    transformers' generate on the same random model; prefill of 4096 tokens."""
    from experiments import gpu_engine, gpu_transformers

    shape = "tiny (dry run)" if dry_run else "8B Llama shape, random bf16 weights"
    print(f"\nDecode step from CUDA graphs, {shape}:")
    result, model = gpu_engine.run_decode_bench(device, dry_run)
    baseline = gpu_transformers.generate_step_ms(
        model, result.cfg, result.dtype, result.batches, result.context, 2 if dry_run else 8
    )
    gpu_engine.print_decode_table(result, baseline)


def run_guarded(name: str, section: Callable[[], object]) -> bool:
    """Runs one section; an exception fails the check but not the sections after it."""
    began = time.perf_counter()
    try:
        ok = section() is not False
    except Exception:
        print(f"  FAIL {name} raised:\n{traceback.format_exc()}")
        ok = False
    print(f"  ({name}: {time.perf_counter() - began:.0f} s)")
    return ok


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m experiments.gpu_check", description=__doc__)
    parser.add_argument(
        "--dry-run-cpu",
        action="store_true",
        help="run the engine sections on CPU with tiny shapes and no graph capture "
        "(proves the code paths; measures nothing)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    start = time.perf_counter()
    if args.dry_run_cpu:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # tiny shapes: more threads only spin against each other
        print(f"gpu_check dry run on CPU, torch {torch.__version__}")
        ok = run_guarded("engine greedy", lambda: run_engine_greedy_check(device, True))
        ok = run_guarded("engine decode", lambda: run_engine_decode_step_bench(device, True)) and ok
    else:
        require_cuda()
        device = torch.device("cuda")
        print(f"gpu_check on {torch.cuda.get_device_name(0)}, torch {torch.__version__}", end="")
        import triton

        print(f", triton {triton.__version__}, python {sys.version.split()[0]}\n")
        ok = run_guarded("kernels", run_kernel_section)
        torch.cuda.empty_cache()
        ok = run_guarded("engine greedy", lambda: run_engine_greedy_check(device)) and ok
        ok = run_guarded("engine decode", lambda: run_engine_decode_step_bench(device)) and ok
    print(f"\ngpu_check {'passed' if ok else 'FAILED'} in {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
