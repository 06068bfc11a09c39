"""The bf16 dot-product linear kernel of several builds side by side, calls interleaved.

    python -m experiments.cpu_linear_ab BUILD.so [BUILD.so ...] [--rows 1 32 2048]
        [--repeats 5] [--threads 1] [--lanes] [--torch] [--gguf Q4_1 Q4_K ...]

Each BUILD.so is a library from the kernel cache (`~/.cache/pdserve/cpu_kernels/`, one
per source hash: an earlier checkout's build stays there). Per row count, every build
runs one pass over SmolLM2-135M's four projections of all 30 layers (bf16 weights, cold
as in a step) and its LM head (49152 x 576), on one thread; `--torch` adds torch's
native bf16 matmul (oneDNN, x rounded to bf16); `--lanes` adds each build's kernel on
the same matrices packed with the outputs in the lanes (`kernels/lanes.py`, what bf16
checkpoints serve on), as BUILD.so+lanes. The builds take turns pass by pass and
each reports its fastest pass in this thread's CPU ms: on a shared machine the minimum
of interleaved runs compares builds far more steadily than medians of separate runs.
`--threads N` (N > 1) runs each call on N threads, as an instance's steps do, and
reports wall-clock ms instead (quiet machines only: CPU time would hide the waits).
`--gguf TYPES` runs the GGUF layer instead (`experiments.cpu_linear`'s random blocks and
shapes, weights decoded to bf16), one table per type.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from experiments.cpu_attention_ab import fastest
from experiments.cpu_linear import GGUF_SHAPES, LAYERS, SHAPES, gguf_pass, random_blocks
from pdserve.kernels import cpu_ops, gguf_blocks, lanes
from pdserve.kernels.cpu_build import BuiltLibrary
from pdserve.kernels.cpu_quantized import CpuQuantizedLinear

HEAD = (49152, 576)
Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def layers_pass(linear: Linear, weights: list[list[torch.Tensor]], xs: dict[int, torch.Tensor]):
    def run() -> None:
        for layer in weights:
            for w in layer:
                linear(xs[w.shape[1]], w)

    return run


def lanes_pass(linear: Callable[..., torch.Tensor], packed: list[list[torch.Tensor]], xs):
    def run() -> None:
        for layer in packed:
            for (n, k), w in zip(SHAPES, layer, strict=True):
                linear(xs[k], w, n)

    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("builds", nargs="+", type=Path)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="N > 1: wall-clock ms")
    parser.add_argument("--torch", action="store_true", help="add torch's native bf16 matmul")
    parser.add_argument("--lanes", action="store_true", help="add the lanes-packed kernel")
    parser.add_argument("--gguf", nargs="+", default=[], help="GGUF block types instead")
    args = parser.parse_args(argv)
    if args.threads < 1:
        raise SystemExit(f"--threads {args.threads}: needs at least 1")
    torch.set_num_threads(args.threads)
    clock, unit = (
        (time.thread_time, "thread CPU") if args.threads == 1 else (time.perf_counter, "wall")
    )
    builds: dict[str, cpu_ops.CpuKernels] = {}
    for p in args.builds:
        kernels = cpu_ops.CpuKernels(BuiltLibrary(p, fresh=False))
        if not kernels.bf16_dot_available:
            raise SystemExit(f"{p}: no bf16 dot products in this build or on this CPU")
        builds[p.name] = kernels
    if args.gguf:
        compare_gguf(builds, args, clock, unit)
        return
    linears: dict[str, Linear] = {name: kernels.linear for name, kernels in builds.items()}
    gen = torch.Generator().manual_seed(0)
    weights = [
        [torch.randn(n, k, generator=gen).bfloat16() for n, k in SHAPES] for _ in range(LAYERS)
    ]
    head = torch.randn(*HEAD, generator=gen).bfloat16()
    if args.lanes:
        packed = [[lanes.pack(w) for w in layer] for layer in weights]
        packed_head = lanes.pack(head)
    lanes_fns = {f"{n}+lanes": k.linear_lanes for n, k in builds.items()} if args.lanes else {}
    names = list(linears) + list(lanes_fns) + (["torch"] if args.torch else [])
    print(
        f"fastest of {args.repeats}, {unit} ms on {args.threads} threads; columns: "
        + ", ".join(names)
    )
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=gen) for _, k in SHAPES}
        xb = {k: x.bfloat16() for k, x in xs.items()}
        passes: dict[str, Callable[[], object]] = {
            n: layers_pass(f, weights, xs) for n, f in linears.items()
        }
        heads: dict[str, Callable[[], object]] = {
            n: partial(f, xs[576], head) for n, f in linears.items()
        }
        for n, f in lanes_fns.items():
            passes[n] = lanes_pass(f, packed, xs)
            heads[n] = partial(f, xs[576], packed_head, HEAD[0])
        if args.torch:
            passes["torch"] = layers_pass(torch.nn.functional.linear, weights, xb)
            heads["torch"] = partial(torch.nn.functional.linear, xb[576], head)
        for what, calls in (("layers", passes), ("LM head", heads)):
            best = fastest(calls, args.repeats, clock)
            cells = " ".join(f"{best[n] * 1e3:9.2f}" for n in names)
            print(f"{rows:6d} rows, {what:8s}{cells}")


def compare_gguf(
    builds: dict[str, cpu_ops.CpuKernels],
    args: argparse.Namespace,
    clock: Callable[[], float],
    unit: str,
) -> None:
    """Per type and row count, each build's fastest pass of the packed layer in bf16."""
    qtypes = {name: q for q, (name, _, _) in gguf_blocks.PACKED_TYPES.items()}
    unknown = [name for name in args.gguf if name not in qtypes]
    if unknown:
        raise SystemExit(f"--gguf: {', '.join(unknown)} not served (served: {gguf_blocks.SERVED})")
    ops = {name: CpuQuantizedLinear(kernels) for name, kernels in builds.items()}
    gen = torch.Generator().manual_seed(0)
    print(
        f"fastest of {args.repeats}, {unit} ms on {args.threads} threads; columns: "
        + ", ".join(ops)
    )
    for name in args.gguf:
        qtype = qtypes[name]
        weights = [[random_blocks(qtype, n, k, gen) for n, k in GGUF_SHAPES] for _ in range(LAYERS)]
        for rows in args.rows:
            xs = {k: torch.randn(rows, k, generator=gen) for _, k in GGUF_SHAPES}
            calls: dict[str, Callable[[], object]] = {
                b: gguf_pass(op, qtype, weights, xs, torch.bfloat16) for b, op in ops.items()
            }
            best = fastest(calls, args.repeats, clock)
            print(f"{name:5s} {rows:6d} rows " + " ".join(f"{best[b] * 1e3:9.2f}" for b in ops))


if __name__ == "__main__":
    main()
