"""The CPU linear layer: the C kernel (every row count, row-invariant) beside torch's
BLAS / oneDNN matmul, over SmolLM2-135M's four projections of all 30 layers.

    python -m experiments.cpu_linear [--rows 1 8 32 128 512 2048] [--threads 2] [--clock cpu]
        [--dtypes float32 bfloat16] [--gguf Q4_1 Q4_K Q5_K Q6_K]

Per row count and weight dtype, the median wall ms of one pass over the 30 layers'
fused QKV (960 x 576), output (576 x 576), gate/up (3072 x 576) and down (576 x 1536)
projections, weights cold as in a real step (each pass walks every layer once). Columns:
the C kernel (float32 x against the stored weight); for bf16 weights on a build with
AVX512-BF16, the C kernel on bf16 dot products (x rounded to bf16); torch with float32
x against the weight widened once to float32; and, for bf16, torch's native bf16 x
bf16 matmul (oneDNN, x rounded to bf16). `same rows` says whether a row's output equals
the C kernel's for that row alone (bit for bit, on every C path), the property the
serving path needs. `--clock cpu` times the process's CPU seconds instead of the wall
(with one thread: the kernel's own work, steadier than the wall on a shared machine),
`--clock thread` the calling thread's (with one thread the kernels run on it).

`--gguf TYPE...` times the packed GGUF layer instead (`linear_gguf`, random blocks with
small scales) per block type, beside the float32 C kernel over the same weights
dequantized, on the same four projections with K cut to whole 256-weight super-blocks
(576 → 512), so every type, K-quants included, runs the same shapes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.kernels import cpu_ops, gguf_blocks
from pdserve.kernels.cpu_quantized import CpuQuantizedLinear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
GGUF_SHAPES = [(960, 512), (512, 512), (3072, 512), (512, 1536)]
LAYERS = 30


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time, "thread": time.thread_time}


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


def random_blocks(qtype: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Packed rows of random values whose float16 scales (and minimums) are small."""
    _, block, size = gguf_blocks.PACKED_TYPES[qtype]
    blocks = torch.randint(0, 256, (n, k // block, size), generator=gen, dtype=torch.uint8)
    halves = {14: (208,), 3: (0, 2), 7: (0, 2), 12: (0, 2), 13: (0, 2)}.get(qtype, (0,))
    for at in halves:
        scale = torch.randn(n, k // block, 1, generator=gen) * 1e-3
        blocks[..., at : at + 2] = scale.half().view(torch.uint8)
    return blocks.reshape(n, -1)


def gguf_pass(op: CpuQuantizedLinear, qtype: int, weights, xs, weight_dtype: torch.dtype):
    """A call that runs the packed layer over every layer's projections once."""

    def run() -> None:
        for layer in weights:
            for (_, k), w in zip(GGUF_SHAPES, layer, strict=True):
                op.linear_gguf(xs[k], w, qtype, None, weight_dtype)

    return run


def gguf_table(kernels: cpu_ops.CpuKernels, names: list[str], args, clock) -> None:
    """Per row count, ms of a pass for each GGUF type, then for float32 weights."""
    qtypes = {name: q for q, (name, _, _) in gguf_blocks.PACKED_TYPES.items()}
    unknown = [name for name in names if name not in qtypes]
    if unknown:
        raise SystemExit(f"--gguf: {', '.join(unknown)} not served (served: {gguf_blocks.SERVED})")
    gen = torch.Generator().manual_seed(0)
    op = CpuQuantizedLinear(kernels)
    weights = {}
    for name in names:
        weights[name] = [
            [random_blocks(qtypes[name], n, k, gen) for n, k in GGUF_SHAPES] for _ in range(LAYERS)
        ]
    first = names[0]
    floats = [[gguf_blocks.dequantize_rows(w, qtypes[first]) for w in ws] for ws in weights[first]]
    halves = [[w.to(torch.bfloat16) for w in ws] for ws in floats]
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    kinds = [(n, d) for n in names for d in args.gguf_weights]
    sizes = [sum(w.numel() for ws in weights[n] for w in ws) / 2**20 for n in names]
    print(f"-- GGUF blocks over {GGUF_SHAPES}, MiB a pass: {[round(s) for s in sizes]}")
    print(
        "-- weights decoded to float32 (exact) or bfloat16 (bf16 panels where the CPU has "
        "bf16 dot products); last columns: the C layer over the dequantized float32 and "
        "bfloat16 copies of the first type"
    )
    print("rows, " + ", ".join(f"{n} {d} ms" for n, d in kinds) + ", float32 C ms, bfloat16 C ms")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=gen) for _, k in GGUF_SHAPES}
        ms = [
            timed(gguf_pass(op, qtypes[n], weights[n], xs, dtypes[d]), args.repeats, clock)
            for n, d in kinds
        ]
        ms.append(timed(one_pass(kernels.linear, floats, xs), args.repeats, clock))
        ms.append(timed(one_pass(kernels.linear, halves, xs), args.repeats, clock))
        print(f"{rows:6d} " + " ".join(f"{v:9.2f}" for v in ms))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512, 2048])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--gguf", nargs="+", default=None, help="GGUF block types to time")
    parser.add_argument(
        "--gguf-weights",
        nargs="+",
        choices=["float32", "bfloat16"],
        default=["float32"],
        help="the dtype the GGUF layer decodes its weights to",
    )
    args = parser.parse_args(argv)
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    kernels = cpu_ops.load()
    print(
        f"{kernels.describe()}; torch {torch.__version__}, {args.threads} threads, "
        f"{args.clock} clock"
    )
    if args.gguf:
        gguf_table(kernels, args.gguf, args, clock)
        return
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
