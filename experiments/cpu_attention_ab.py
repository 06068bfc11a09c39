"""CPU attention kernels of several builds side by side, calls interleaved.

    python -m experiments.cpu_attention_ab BUILD.so [BUILD.so ...] [--repeats 15]

Each BUILD.so is a library from the kernel cache (`~/.cache/pdserve/cpu_kernels/`, one
per source hash: an earlier checkout's build stays there). Every build runs SmolLM2's
shapes (9 query / 3 kv heads, head_dim 64, block 16, bf16 cache) on one thread: one
2048-token prefill, and decode of 32 sequences x 256 of context. The builds take turns
call by call and each reports its fastest call in this thread's CPU time: on a shared
machine the minimum of interleaved calls compares builds far more steadily than
medians of separate runs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch

from experiments.cpu_attention import make_cache
from pdserve.kernels import cpu_ops
from pdserve.kernels.cpu_build import BuiltLibrary


def fastest(
    calls: dict[str, Callable[[], object]],
    repeats: int,
    clock: Callable[[], float] = time.thread_time,
) -> dict[str, float]:
    """Each call's fastest run in seconds of `clock` (this thread's CPU time unless
    said), the calls taking turns."""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):
        for name, call in calls.items():
            start = clock()
            call()
            best[name] = min(best[name], clock() - start)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("builds", nargs="+", type=Path)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    builds = {p.name: cpu_ops.CpuKernels(BuiltLibrary(p, fresh=False)) for p in args.builds}
    shapes = argparse.Namespace(
        block_size=16, kv_heads=3, head_dim=64, dtype="bfloat16", kv_cache_dtype="auto"
    )
    gen = torch.Generator().manual_seed(0)
    caches, tables, lens = make_cache(1, 2048, shapes, gen)
    q = torch.randn(2048, 9, 64, generator=gen).bfloat16()
    starts = torch.tensor([0, 2048], dtype=torch.int32)
    prefill = {
        name: (lambda k=k: k.prefill_attention(q, caches[1], tables, starts, lens, 0.125))
        for name, k in builds.items()
    }
    d_caches, d_tables, d_lens = make_cache(32, 256, shapes, gen)
    dq = torch.randn(32, 9, 64, generator=gen).bfloat16()
    turn = iter(range(1 << 30))  # each call a different layer, as in a step
    decode = {
        name: (
            lambda k=k: k.decode_attention(
                dq, d_caches[next(turn) % len(d_caches)], d_tables, d_lens, 0.125
            )
        )
        for name, k in builds.items()
    }
    for label, calls in (("prefill 2048", prefill), ("decode 32 x 256", decode)):
        best = fastest(calls, args.repeats)
        print(label, "  ".join(f"{name}: {s * 1e3:.2f} ms" for name, s in best.items()))


if __name__ == "__main__":
    main()
