"""The CPU linear layer: the C kernel (every row count, row-invariant) beside torch's
BLAS / oneDNN matmul, over SmolLM2-135M's four projections of all 30 layers.

    python -m experiments.cpu_linear [--rows 1 8 32 128 512 2048] [--threads 2] [--clock cpu]
        [--dtypes float32 bfloat16]

Per row count and weight dtype, the median wall ms of one pass over the 30 layers'
fused QKV (960 x 576), output (576 x 576), gate/up (3072 x 576) and down (576 x 1536)
projections, weights cold as in a real step (each pass walks every layer once). Columns:
the C kernel (float32 x against the stored weight); for bf16 weights on a build with
AVX512-BF16, the C kernel on bf16 dot products (x rounded to bf16); torch with float32
x against the weight widened once to float32; and, for bf16, torch's native bf16 x
bf16 matmul (oneDNN, x rounded to bf16). `same rows` says whether a row's output equals
the C kernel's for that row alone (bit for bit, on every C path), the property the
serving path needs. `--clock cpu` times the process's CPU seconds instead of the wall
(with one thread: the kernel's own work, steadier than the wall on a shared machine).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.kernels import cpu_ops

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def timed(fn, repeats: int, clock=time.perf_counter) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times) * 1e3


def one_pass(linear, weights: list[list[torch.Tensor]], xs: dict[int, torch.Tensor]):
    """A call that runs `linear` over every layer's projections once."""

    def run() -> None:
        for layer in weights:
            for w in layer:
                linear(xs[w.shape[1]], w)

    return run


def c_pass_on(kernels: cpu_ops.CpuKernels, dot: bool, weights, xs):
    """A pass of the C kernel on the float32 (dot False) or bf16 dot-product path."""

    def run() -> None:
        kernels.bf16_dot = dot
        one_pass(kernels.linear, weights, xs)()

    return run


def same_rows(kernels: cpu_ops.CpuKernels, dot: bool, w: torch.Tensor, x: torch.Tensor) -> bool:
    kernels.bf16_dot = dot
    whole = kernels.linear(x, w)
    return all(
        torch.equal(kernels.linear(x[i : i + 1], w), whole[i : i + 1]) for i in (0, len(x) - 1)
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512, 2048])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    kernels = cpu_ops.load()
    print(
        f"{kernels.describe()}; torch {torch.__version__}, {args.threads} threads, "
        f"{args.clock} clock"
    )
    gen = torch.Generator().manual_seed(0)
    for dtype in [getattr(torch, name) for name in args.dtypes]:
        weights = [
            [torch.randn(n, k, generator=gen).to(dtype) for n, k in SHAPES] for _ in range(LAYERS)
        ]
        wide = (
            [[w.float() for w in layer] for layer in weights] if dtype != torch.float32 else weights
        )
        name = str(dtype).removeprefix("torch.")
        dots = [False, True] if dtype == torch.bfloat16 and kernels.bf16_dot_available else [False]
        print(
            f"-- {name} weights: rows, C ms, C bf16-dot ms, torch f32 ms, torch native ms, "
            "same rows"
        )
        for rows in args.rows:
            xs = {k: torch.randn(rows, k, generator=gen) for _, k in SHAPES}
            xb = {k: x.to(dtype) for k, x in xs.items()}
            c_ms = [
                timed(c_pass_on(kernels, dot, weights, xs), args.repeats, clock) for dot in dots
            ]
            c_ms += [float("nan")] * (2 - len(c_ms))
            t_ms = timed(one_pass(torch.nn.functional.linear, wide, xs), args.repeats, clock)
            native_pass = one_pass(torch.nn.functional.linear, weights, xb)
            n_ms = (
                timed(native_pass, args.repeats, clock) if dtype != torch.float32 else float("nan")
            )
            w = weights[0][2]
            same = all(same_rows(kernels, dot, w, xs[w.shape[1]]) for dot in dots)
            print(f"{rows:6d} {c_ms[0]:9.2f} {c_ms[1]:9.2f} {t_ms:9.2f} {n_ms:9.2f}   {same}")
        kernels.bf16_dot = kernels.bf16_dot_available


if __name__ == "__main__":
    main()
