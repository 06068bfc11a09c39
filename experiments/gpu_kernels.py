"""The kernel half of the device check: Triton kernels against their references on
CUDA, then decode-attention bandwidth and prefill-attention throughput tables.

Imports only torch and `kernels` (triton through it), so it runs on a GPU machine's
own Python/torch/triton without the project's other dependencies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from experiments.gpu_outcome import Outcome
from pdserve.kernels import reference
from pdserve.kernels.triton_activation import silu_and_mul_triton
from pdserve.kernels.triton_decode import decode_attention_triton, plan_decode
from pdserve.kernels.triton_kv_write import write_kv_cache_triton
from pdserve.kernels.triton_norm import rms_norm_triton
from pdserve.kernels.triton_prefill import prefill_attention_kernel, prefill_attention_triton
from pdserve.kernels.triton_rotary import rotary_embedding_triton

Tensor = torch.Tensor
DEVICE = "cuda"  # a CPU dry run under TRITON_INTERPRET=1 may set "cpu" (checks only)
COPY_BANDWIDTH = 4.2e12  # bytes/s measured on the H200 (target: >= 70%)
TOLERANCE = {
    torch.float32: 1e-4,
    torch.float16: 3e-3,
    torch.bfloat16: 2e-2,
}
# One layer of the 8B Llama shape.
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16


@dataclass
class Paged:
    kv_cache: Tensor
    block_tables: Tensor
    context_lens: Tensor


def make_paged(
    lens: list[int],
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_layers: int = 2,
    poison: bool = True,
) -> Paged:
    """Random KV for each sequence in shuffled blocks of a block-major storage; the
    returned cache is layer 0's block-strided view. Unwritten slots hold NaN."""
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + 1
    shape = (num_blocks, num_layers, 2, kv_heads, block_size, head_dim)
    fill = float("nan") if poison else 0.0
    storage = torch.full(shape, fill, dtype=dtype, device=DEVICE)
    cache = storage[:, 0]
    order = torch.randperm(num_blocks, device=DEVICE)
    width = max(per_seq)
    tables = torch.zeros(len(lens), width, dtype=torch.int32, device=DEVICE)
    used = 0
    for s, (n, nb) in enumerate(zip(lens, per_seq, strict=True)):
        blocks = order[used : used + nb]
        used += nb
        tables[s, :nb] = blocks.int()
        view = cache[blocks]  # [nb, 2, kvh, bs, d] copy; written back below
        view.view(nb, 2, kv_heads, block_size, head_dim).normal_()
        if n % block_size:
            view[-1, :, :, n % block_size :] = fill
        cache[blocks] = view
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return Paged(cache, tables, lens_t)


def _max_error(got: Tensor, want: Tensor) -> float:
    if got.isnan().any():
        return math.inf
    return float((got.float() - want.float()).abs().max())


def _report(name: str, got: Tensor, want: Tensor, dtype: torch.dtype) -> bool:
    error = _max_error(got, want)
    ok = error <= TOLERANCE[dtype] * max(1.0, float(want.float().abs().max()))
    print(f"  {'ok  ' if ok else 'FAIL'} {name}: max |triton - reference| = {error:.2e}")
    return ok


def check_decode(heads, kv_heads, d, bs, dtype, lens, window) -> bool:
    paged = make_paged(lens, kv_heads, d, bs, dtype)
    query = torch.randn(len(lens), heads, d, device=DEVICE, dtype=dtype)
    args = (query, paged.kv_cache, paged.block_tables, paged.context_lens, d**-0.5, window)
    got = decode_attention_triton(*args, torch.full_like(query, float("nan")))
    want = reference.decode_attention_ref(*args)
    name = f"decode h{heads}/{kv_heads} d{d} bs{bs} {dtype} lens={lens} window={window}"
    return _report(name, got, want, dtype)


def check_decode_in_cuda_graph() -> bool:
    """The decode launch has no host sync: it captures and replays in a CUDA graph."""
    paged = make_paged([1, 700, 3000, 17], KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE)
    query = torch.randn(4, HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    out = torch.empty_like(query)
    args = (query, paged.kv_cache, paged.block_tables, paged.context_lens, HEAD_DIM**-0.5)
    decode_attention_triton(*args, None, out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention_triton(*args, None, out)
    query.normal_()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return _report(
        "decode replayed from a CUDA graph", out, reference.decode_attention_ref(*args), DTYPE
    )


def check_prefill(heads, kv_heads, d, bs, dtype, seqs, window) -> bool:
    """seqs: (context_len, new_tokens) per sequence."""
    paged = make_paged([c for c, _ in seqs], kv_heads, d, bs, dtype)
    starts = [0]
    for _, new in seqs:
        starts.append(starts[-1] + new)
    qsl = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    query = torch.randn(starts[-1], heads, d, device=DEVICE, dtype=dtype)
    args = (query, paged.kv_cache, paged.block_tables, qsl, paged.context_lens, d**-0.5, window)
    got = prefill_attention_triton(*args, torch.full_like(query, float("nan")))
    want = reference.prefill_attention_ref(*args)
    return _report(
        f"prefill h{heads}/{kv_heads} d{d} {dtype} seqs={seqs} w={window}", got, want, dtype
    )


def compiled_variants(kernel) -> int:
    """How many specializations of a Triton kernel are compiled for the current device."""
    caches = kernel.device_caches[torch.cuda.current_device()]
    return len(caches[0])


def check_prefill_compiles_once() -> bool:
    """Prompts of any length and batches of any size reuse one compiled prefill kernel
    (a served GPU's first prompts would otherwise each wait for a compile)."""
    batches = [[(5, 5)], [(40, 40)], [(300, 300)], [(1000, 1000)], [(40, 40), (17, 0)]]
    batches.append([(33, 33), (16, 16), (2, 2)])
    check_prefill(32, 8, 128, 16, torch.bfloat16, batches[0], None)
    before = compiled_variants(prefill_attention_kernel)
    ok = all([check_prefill(32, 8, 128, 16, torch.bfloat16, b, None) for b in batches[1:]])
    added = compiled_variants(prefill_attention_kernel) - before
    print(
        f"  {'ok' if added == 0 and ok else 'FAIL'}   prefill compiles once: {added} more variants"
    )
    return added == 0 and ok


def check_kv_write(dtype) -> bool:
    storage = torch.randn(64, 2, 2, KV_HEADS, BLOCK_SIZE, HEAD_DIM, device=DEVICE).to(dtype)
    qkv = torch.randn(100, HEADS + 2 * KV_HEADS, HEAD_DIM, device=DEVICE, dtype=dtype)
    key, value = qkv[:, HEADS : HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS :]
    slots = torch.randperm(64 * BLOCK_SIZE, device=DEVICE)[:100]
    slots[::7] = -1
    want, got = storage.clone(), storage.clone()
    reference.write_kv_cache_ref(key, value, want[:, 1], slots)
    write_kv_cache_triton(key, value, got[:, 1], slots)
    ok = torch.equal(got, want)
    print(f"  {'ok  ' if ok else 'FAIL'} kv write {dtype}: bit-exact = {ok}")
    return ok


def check_rms_norm(dtype) -> bool:
    x = torch.randn(33, 4096, device=DEVICE, dtype=dtype)
    residual = torch.randn_like(x)
    weight = torch.randn(4096, device=DEVICE, dtype=dtype)
    got, got_res = rms_norm_triton(x, weight, 1e-5, residual)
    want, want_res = reference.rms_norm_ref(x, weight, 1e-5, residual)
    ok_res = _report(f"rms_norm residual sum {dtype}", got_res, want_res, dtype)
    return _report(f"rms_norm {dtype}", got, want, dtype) and ok_res


def check_silu_and_mul(dtype) -> bool:
    gate_up = 4 * torch.randn(33, 2 * 14336, device=DEVICE, dtype=dtype)
    got, want = silu_and_mul_triton(gate_up), reference.silu_and_mul_ref(gate_up)
    return _report(f"silu_and_mul {dtype}", got, want, dtype)


def check_rotary(dtype) -> bool:
    inv = 1.0 / (500000 ** (torch.arange(0, HEAD_DIM, 2, device=DEVICE).float() / HEAD_DIM))
    angles = torch.outer(torch.arange(8192, device=DEVICE).float(), inv)
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    qkv = torch.randn(77, HEADS + 2 * KV_HEADS, HEAD_DIM, device=DEVICE, dtype=dtype)
    query, key = qkv[:, :HEADS], qkv[:, HEADS : HEADS + KV_HEADS]
    positions = torch.randint(0, 8192, (77,), device=DEVICE)
    got = rotary_embedding_triton(positions, query, key, cos_sin)
    want = reference.rotary_embedding_ref(positions, query, key, cos_sin)
    return _report(f"rotary q {dtype}", got[0], want[0], dtype) and _report(
        f"rotary k {dtype}", got[1], want[1], dtype
    )


def _cases(dry_run: bool) -> list[Callable[[], bool]]:
    """The checks: the 8B layer's shapes and edge cases on a GPU; small ones under
    the interpreter, each kernel still through its GQA, window, split-K and dtype paths."""
    cases: list[Callable[[], bool]] = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        cases += [lambda d=dtype: check_kv_write(d), lambda d=dtype: check_rms_norm(d)]
        cases.append(lambda d=dtype: check_rotary(d))
        cases.append(lambda d=dtype: check_silu_and_mul(d))
    if dry_run:
        return cases + [
            lambda: check_decode(4, 2, 32, 16, torch.float32, [1, 15, 16, 17, 70], None),
            lambda: check_decode(4, 2, 32, 16, torch.bfloat16, [3, 600], None),  # split-K
            lambda: check_decode(6, 2, 32, 16, torch.float16, [1, 40], 24),
            lambda: check_prefill(4, 2, 32, 16, torch.float32, [(40, 40), (33, 5), (1, 1)], None),
            lambda: check_prefill(4, 2, 32, 16, torch.bfloat16, [(70, 20), (17, 17)], 16),
        ]
    return cases + [
        lambda: check_decode(32, 8, 128, 16, torch.bfloat16, [1, 15, 16, 17, 4096, 700], None),
        lambda: check_decode(32, 8, 128, 16, torch.bfloat16, [16384], None),  # split-K
        lambda: check_decode(9, 3, 64, 16, torch.float16, [1, 33, 2000], 256),
        lambda: check_decode(8, 1, 256, 32, torch.float32, [31, 32, 33, 5000], None),
        lambda: check_decode(16, 8, 128, 32, torch.bfloat16, [1] * 40 + [3000], 1000),
        check_decode_in_cuda_graph,
        lambda: check_prefill(32, 8, 128, 16, torch.bfloat16, [(4096, 4096)], None),
        lambda: check_prefill(
            32, 8, 128, 16, torch.bfloat16, [(300, 300), (2000, 77), (17, 0), (1, 1)], None
        ),
        lambda: check_prefill(9, 3, 64, 16, torch.float16, [(1000, 500), (129, 129)], 256),
        lambda: check_prefill(8, 2, 256, 32, torch.bfloat16, [(600, 200), (64, 64)], None),
        lambda: check_prefill(8, 4, 128, 16, torch.float32, [(513, 257)], 100),
        check_prefill_compiles_once,
    ]


def check_all_kernels(dry_run: bool = False) -> tuple[int, int]:
    """Every Triton kernel against its reference on a few shapes: (passed, checks)."""
    torch.manual_seed(0)
    where = "CPU, TRITON_INTERPRET=1" if dry_run else "CUDA"
    print(f"Triton kernels against the torch references ({where}):")
    results = [case() for case in _cases(dry_run)]
    passed = sum(results)
    print(f"  {passed}/{len(results)} kernel checks passed")
    return passed, len(results)


def run_section(device: torch.device, dry_run: bool) -> Outcome:
    """The `kernels` section: the checks, then (on a GPU) the bandwidth and TFLOP/s tables."""
    global DEVICE
    DEVICE = device.type
    passed, total = check_all_kernels(dry_run)
    if not dry_run:
        bench_decode_bandwidth()
        bench_prefill_throughput()
    if passed < total:
        return Outcome.failed(f"{total - passed} of {total} kernel checks off their references")
    return Outcome.ok()


def time_cuda(
    fn: Callable[[], object], iters: int = 20, warmup: int = 3, graph: bool = False
) -> float:
    """Median seconds per call, each call timed by CUDA events after an L2 flush. With
    `graph`, the call is captured once and each timed call is a replay: the kernels'
    time without the Python launch, which dominates small decode batches."""
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=DEVICE)
    for _ in range(warmup):
        fn()
    if graph:
        torch.cuda.synchronize()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn()
        fn = captured.replay
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def bench_decode_bandwidth() -> None:
    """Decode attention at batch 1/32/128 x context 1k/4k/16k, one 8B layer: per call
    from Python, and replayed from a CUDA graph (as the engine runs decode; GB/s from it)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(
        f"\nDecode attention, one layer of the 8B shape ({HEADS} q / {KV_HEADS} kv heads, "
        f"head_dim {HEAD_DIM}, block {BLOCK_SIZE}, bf16); bytes = K+V read:"
    )
    print(
        f"  {'batch':>5} {'context':>7} {'splits':>6} {'call us':>9} {'graph us':>9} "
        f"{'GB/s':>8} {'of 4.2TB/s':>10}"
    )
    for batch in (1, 32, 128):
        for context in (1024, 4096, 16384):
            paged = make_paged(
                [context] * batch, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE, poison=False
            )
            query = torch.randn(batch, HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
            out = torch.empty_like(query)
            args = (query, paged.kv_cache, paged.block_tables, paged.context_lens, HEAD_DIM**-0.5)
            call = time_cuda(lambda a=args, o=out: decode_attention_triton(*a, None, o))
            seconds = time_cuda(
                lambda a=args, o=out: decode_attention_triton(*a, None, o), graph=True
            )
            kv_bytes = batch * context * KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize
            span = paged.block_tables.shape[1] * BLOCK_SIZE
            splits = plan_decode(batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM, span, sms).num_splits
            rate = kv_bytes / seconds
            print(
                f"  {batch:>5} {context:>7} {splits:>6} {call * 1e6:>9.1f} {seconds * 1e6:>9.1f} "
                f"{rate / 1e9:>8.0f} {rate / COPY_BANDWIDTH:>9.0%}"
            )
            del paged


def bench_prefill_throughput() -> None:
    """Prefill attention TFLOP/s at 4k context, 8B layer shape."""
    print("\nPrefill attention, one layer of the 8B shape, causal FLOPs (4 * heads * d per pair):")
    print(f"  {'batch':<34} {'time ms':>8} {'TFLOP/s':>8}")
    for label, seqs in (
        ("1 x 4096 new tokens", [(4096, 4096)]),
        ("1 x 2048 new over 2048 cached", [(4096, 2048)]),
        ("4 x 4096 new tokens", [(4096, 4096)] * 4),
    ):
        paged = make_paged(
            [c for c, _ in seqs], KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE, poison=False
        )
        starts = [0]
        pairs = 0
        for ctx, new in seqs:
            starts.append(starts[-1] + new)
            pairs += new * (ctx - new) + new * (new + 1) // 2
        qsl = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
        query = torch.randn(starts[-1], HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        out = torch.empty_like(query)
        args = (query, paged.kv_cache, paged.block_tables, qsl, paged.context_lens, HEAD_DIM**-0.5)
        seconds = time_cuda(lambda a=args, o=out: prefill_attention_triton(*a, None, o), iters=10)
        flops = 4 * HEADS * HEAD_DIM * pairs
        print(f"  {label:<34} {seconds * 1e3:>8.3f} {flops / seconds / 1e12:>8.1f}")
