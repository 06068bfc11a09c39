"""CPU paged attention: the C kernels beside the torch references, per layer.

    python -m experiments.cpu_attention [--threads 1 2] [--repeats 7] [--clock cpu]
        [--skip-reference] [--kv-cache-dtype fp8_e4m3]

Shapes are SmolLM2-135M's (9 query heads over 3 kv heads, head_dim 64, block size 16,
bfloat16 cache) unless overridden. Decode runs batch 1 and 32 at contexts 256 and 2048;
prefill runs one 2048-token prompt (a full chunk) from an empty cache. The cache is a
block-strided per-layer view of a block-major storage, as the engine allocates it,
with shuffled block ids; each timed call uses the next layer, cycling through enough
layers that the KV data does not sit in the last-level cache between calls (as in a
real step over 30 layers). Prints the median ms per call and, for decode, the
effective GB/s of KV read (keys + values of every visible token, once). `--clock cpu`
times the process's CPU seconds (on a shared machine, what the call cost rather than
what it waited for); `--skip-reference` times the C kernels alone. `--kv-cache-dtype
fp8_e4m3` (or `fp8_e5m2`) stores the cache in FP8, as `pdserve serve --kv-cache-dtype`
does, with the query still in `--dtype` (scales 1.0: the kernels' work is the same).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from pdserve.kernels import cpu_ops, dispatch, reference

Tensor = torch.Tensor
# Layers cycled through so the KV touched between two uses of a layer exceeds this.
COLD_BYTES = 192 << 20
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
clock = time.perf_counter


def make_cache(
    num_seqs: int, context: int, args: argparse.Namespace, gen: torch.Generator
) -> tuple[list[Tensor], Tensor, Tensor]:
    """Per-layer cache views, block tables and context lengths, KV filled at random."""
    dtype = cache_dtype(args)
    bs, kvh, d = args.block_size, args.kv_heads, args.head_dim
    blocks_per_seq = -(-context // bs)
    num_blocks = num_seqs * blocks_per_seq
    layer_bytes = num_blocks * 2 * kvh * bs * d * dtype.itemsize
    layers = max(1, min(30, -(-COLD_BYTES // layer_bytes)))
    storage = torch.randn(num_blocks, layers, 2, kvh, bs, d, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = order.view(num_seqs, blocks_per_seq)
    lens = torch.full((num_seqs,), context, dtype=torch.int32)
    return [storage[:, layer] for layer in range(layers)], tables, lens


def cache_dtype(args: argparse.Namespace) -> torch.dtype:
    return FP8.get(args.kv_cache_dtype) or getattr(torch, args.dtype)


def time_calls(fn: Callable[[Tensor], object], caches: list[Tensor], repeats: int) -> float:
    """Median seconds of fn(cache) over `repeats` calls, a different layer each time."""
    fn(caches[0])
    times = []
    for i in range(repeats):
        cache = caches[(i + 1) % len(caches)]
        start = clock()
        fn(cache)
        times.append(clock() - start)
    return statistics.median(times)


def bench_decode(
    args: argparse.Namespace, impls: dict[str, Callable], num_seqs: int, context: int, gen
) -> list[str]:
    caches, tables, lens = make_cache(num_seqs, context, args, gen)
    dtype = getattr(torch, args.dtype)
    query = torch.randn(num_seqs, args.heads, args.head_dim, generator=gen).to(dtype)
    kv_bytes = num_seqs * context * 2 * args.kv_heads * args.head_dim * caches[0].itemsize
    scale = args.head_dim**-0.5
    rows = []
    for name, fn in impls.items():
        call = lambda c, fn=fn: fn(query, c, tables, lens, scale)  # noqa: E731
        rows.append((name, time_calls(call, caches, args.repeats)))
    return _format(f"decode  batch {num_seqs:>2} x ctx {context:>4}", rows, kv_bytes)


def bench_prefill(args: argparse.Namespace, impls: dict[str, Callable], tokens: int, gen):
    caches, tables, lens = make_cache(1, tokens, args, gen)
    dtype = getattr(torch, args.dtype)
    query = torch.randn(tokens, args.heads, args.head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0, tokens], dtype=torch.int32)
    scale = args.head_dim**-0.5
    rows = []
    for name, fn in impls.items():
        call = lambda c, fn=fn: fn(query, c, tables, starts, lens, scale)  # noqa: E731
        rows.append((name, time_calls(call, caches, max(3, args.repeats // 2))))
    return _format(f"prefill 1 x {tokens} new tokens", rows, None)


def _format(label: str, rows: list[tuple[str, float]], kv_bytes: int | None) -> list[str]:
    ref = dict(rows).get("reference")
    lines = []
    for name, seconds in rows:
        rate = f"{kv_bytes / seconds / 1e9:6.2f} GB/s" if kv_bytes else " " * 11
        ratio = f"  x{ref / seconds:5.1f}" if ref else ""
        lines.append(f"{label}  {name:<9} {seconds * 1e3:9.3f} ms  {rate}{ratio}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", *FP8], help="auto: --dtype"
    )
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--skip-reference", action="store_true")
    args = parser.parse_args(argv)
    global clock
    clock = CLOCKS[args.clock]
    cpu_ops.load()  # builds on a first run: not part of the load time below
    start = time.perf_counter()
    kernels = cpu_ops.load()
    load_ms = (time.perf_counter() - start) * 1e3
    print(f"CPU kernels: {kernels.describe()}; loading an existing build {load_ms:.1f} ms")
    print(f"{args.clock} clock; load average", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    if not dispatch.load_cpu_kernels():
        print(f"(dispatch would use the references: {dispatch.cpu_kernels_status()})")
    decode = {"reference": reference.decode_attention_ref, "C kernel": kernels.decode_attention}
    prefill = {"reference": reference.prefill_attention_ref, "C kernel": kernels.prefill_attention}
    if args.skip_reference:
        del decode["reference"], prefill["reference"]
    gen = torch.Generator().manual_seed(0)
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"-- {threads} thread(s)")
        for num_seqs in args.batches:
            for context in args.contexts:
                print("\n".join(bench_decode(args, decode, num_seqs, context, gen)), flush=True)
        if args.prefill_tokens:
            print("\n".join(bench_prefill(args, prefill, args.prefill_tokens, gen)), flush=True)
    print("load average", " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
