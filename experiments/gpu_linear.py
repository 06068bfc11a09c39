"""Whether a split-K Triton kernel beats cuBLAS at the decode-shaped linear layers of an
8B model (qkv, o, gate/up, down at 1-128 rows): cuBLAS beside the kernel below, with
its default configuration and a sweep. The engine keeps cuBLAS: BENCHMARKS.md has the
figures (the best configurations gain 0-5 %, about 2 % of a batch-64 step).

    python -m experiments.gpu_linear [--rows 1,16,64,128] [--sweep-rows 64] [--dry-run-cpu]

Each case is timed as the engine runs it: a CUDA graph of calls back to back, each on
another copy of the weight (copies enough that L2 holds none of them), so a time is a
weight streamed from memory. GB/s counts weight bytes.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_common import check_float, num_sms, upcast_dot

Tensor = torch.Tensor
# (name, N, K) of one 8B Llama layer's decode linears.
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
DRY_SHAPES = [("qkv", 96, 64), ("down", 64, 256)]
STREAM_BYTES = 1 << 30  # weight bytes one timed graph streams


class LinearConfig(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


@triton.jit
def skinny_linear_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = pid_k * k_per_split
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_begin, k_begin + k_per_split, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        kmask = ks < K
        a = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
            mask=(rows < M)[:, None] & kmask[None, :],
            other=0.0,
        )
        b = tl.load(
            w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :],
            mask=(cols < N)[:, None] & kmask[None, :],
            other=0.0,
        )
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(b))
    out = out_ptr + pid_k.to(tl.int64) * stride_os
    out += rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit
def split_sum_kernel(
    part_ptr,
    bias_ptr,
    out_ptr,
    N,
    stride_ps,
    stride_pm,
    stride_om,
    SPLITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLITS):
        acc += tl.load(part_ptr + s * stride_ps + row * stride_pm + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def block_m(rows: int) -> int:
    """The row tile: tl.dot needs at least 16."""
    return max(16, min(64, triton.next_power_of_2(rows)))


def pick_config(rows: int, n: int, k: int, sms: int) -> LinearConfig:
    """Enough programs for two per multiprocessor, K slices of at least 1024 columns."""
    block_n = 64
    tiles = triton.cdiv(n, block_n) * triton.cdiv(rows, block_m(rows))
    split = 1
    while tiles * split < 2 * sms and k // (2 * split) >= 1024:
        split *= 2
    return LinearConfig(block_n=block_n, block_k=128, split_k=split, num_warps=4, num_stages=4)


def linear_triton(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, config: LinearConfig | None = None
) -> Tensor:
    """`x @ weight.T + bias` for a weight of x's dtype, `config` or `pick_config`'s."""
    check_float("x", x)
    if weight.dtype != x.dtype or weight.dim() != 2 or weight.shape[-1] != x.shape[-1]:
        raise ValueError(
            f"weight {tuple(weight.shape)} {weight.dtype} does not fit x {tuple(x.shape)} {x.dtype}"
        )
    n, k = weight.shape
    rows2d = x.reshape(-1, k)
    if rows2d.stride(-1) != 1:
        rows2d = rows2d.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = rows2d.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0 or k == 0:
        return out.zero_().view(*x.shape[:-1], n)
    cfg = config or pick_config(m, n, k, num_sms(x))
    bm = block_m(m)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)
    direct = splits == 1 and bias is None
    target = out if direct else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    skinny_linear_kernel[(triton.cdiv(n, cfg.block_n), splits, triton.cdiv(m, bm))](
        rows2d,
        weight,
        target,
        m,
        n,
        k,
        k_per_split,
        rows2d.stride(0),
        weight.stride(0),
        target.stride(-2),
        0 if direct else target.stride(0),
        BLOCK_M=bm,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        UPCAST=upcast_dot(x, x.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if not direct:
        block = 1024
        split_sum_kernel[(m, triton.cdiv(n, block))](
            target,
            target if bias is None else bias,
            out,
            n,
            target.stride(0),
            target.stride(1),
            out.stride(0),
            SPLITS=splits,
            HAS_BIAS=bias is not None,
            BLOCK=block,
            num_warps=4,
        )
    return out.view(*x.shape[:-1], n)


def graph_us(calls: list[Callable[[], object]], device: torch.device, repeats: int = 10) -> float:
    """Median microseconds per call of `calls` replayed as one CUDA graph."""
    for call in calls[:2]:
        call()
    if device.type != "cuda":
        return 0.0
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(calls))
    return statistics.median(times)


def sweep_configs() -> list[LinearConfig]:
    out = []
    for bn, bk, stages, warps in itertools.product(
        (32, 64, 128), (64, 128, 256), (3, 4, 5), (4, 8)
    ):
        if warps == 8 and bn < 64:
            continue
        for split in (1, 2, 4, 8):
            out.append(LinearConfig(bn, bk, split, warps, stages))
    return out


def check(x: Tensor, w: Tensor, cfg: LinearConfig | None) -> float:
    want = torch.nn.functional.linear(x.float(), w.float())
    got = linear_triton(x, w, None, cfg).float()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


def measure_shape(name: str, n: int, k: int, rows: int, sweep: bool, device, dtype) -> None:
    copies = max(2, min(64, STREAM_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, dtype=dtype, device=device) / k**0.5 for _ in range(copies)]
    x = torch.randn(rows, k, dtype=dtype, device=device)
    nbytes = n * k * dtype.itemsize

    def gbs(us: float) -> str:
        return f"{nbytes / (us * 1e-6) / 1e9:7.0f}" if us > 0 else "      -"

    cublas = graph_us([lambda w=w: torch.nn.functional.linear(x, w) for w in weights], device)
    transposed = [w.t().contiguous() for w in weights[: max(2, copies // 2)]]
    cublas_t = graph_us([lambda w=w: x @ w for w in transposed], device)
    del transposed
    default = pick_config(
        rows,
        n,
        k,
        torch.cuda.get_device_properties(0).multi_processor_count if device.type == "cuda" else 8,
    )
    err = check(x, weights[0], None)
    triton_us = graph_us([lambda w=w: linear_triton(x, w) for w in weights], device)
    print(
        f"{name:>8} {rows:>4} {n:>6} {k:>6} | cuBLAS {cublas:8.1f} us {gbs(cublas)} GB/s"
        f" | x@W^T {cublas_t:8.1f} | triton {triton_us:8.1f} us {gbs(triton_us)} GB/s"
        f" {tuple(default)} err {err:.1e}",
        flush=True,
    )
    if not sweep:
        return
    results = []
    for cfg in sweep_configs() if device.type == "cuda" else sweep_configs()[:3]:
        try:
            us = graph_us(
                [lambda w=w, c=cfg: linear_triton(x, w, None, c) for w in weights], device, 5
            )
        except Exception as exc:  # a config the device cannot run (shared memory)
            print(f"    {tuple(cfg)} failed: {type(exc).__name__}", flush=True)
            continue
        results.append((us, cfg))
    results.sort(key=lambda r: r[0])
    for us, cfg in results[:5]:
        print(
            f"    best {tuple(cfg)}: {us:8.1f} us {gbs(us)} GB/s"
            f" err {check(x, weights[0], cfg):.1e}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.gpu_linear")
    parser.add_argument("--rows", default="1,16,32,64,128")
    parser.add_argument("--sweep-rows", default="64")
    parser.add_argument("--dry-run-cpu", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.dry_run_cpu else "cuda")
    shapes = DRY_SHAPES if args.dry_run_cpu else SHAPES
    sweep_rows = {int(r) for r in args.sweep_rows.split(",") if r}
    torch.manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        for name, n, k in shapes:
            measure_shape(name, n, k, rows, rows in sweep_rows, device, torch.bfloat16)


if __name__ == "__main__":
    main()
