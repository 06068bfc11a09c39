"""What the tests of the C linear layers (float, int8, GGUF) check alike: a row's output
independent of the rest of the call, the dispatch to the C binding and back, the AVX2
build run in a child process, and the packed GGUF layers' grid cases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch

from pdserve.kernels import dispatch
from pdserve.kernels.cpu_build import cpu_flags

# Row counts of a 300-row call's tail: every tile shape, and a block of rows past the first.
TAIL_ROWS = (1, 2, 3, 5, 64, 65, 300)


def cpu_has(*flags: str) -> bool:
    """Whether this CPU lists every flag (Linux's names: avx2, fma, avx512_bf16...)."""
    return set(flags) <= cpu_flags()


def assert_rows_independent(
    linear: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    threads: Callable[[int], None],
) -> None:
    """Bit for bit: the last rows of x alone, at 1 or 2 threads, give the rows the whole
    of x gives at 2 threads (BLAS does not: it picks its kernel by the row count)."""
    threads(2)
    whole = linear(x)
    for rows in TAIL_ROWS:
        for num_threads in (1, 2):
            threads(num_threads)
            assert torch.equal(linear(x[-rows:]), whole[-rows:]), (rows, num_threads)


def assert_dispatches_to(name: str, binding: type, reference: Callable[..., Any]) -> Callable:
    """The op `name` on a CPU tensor runs a method of `binding` with the C kernels on,
    its reference with them off; returns the method."""
    x = torch.zeros(1)
    before = dispatch._cpu_enabled
    dispatch.set_cpu_kernels_enabled(True)
    try:
        chosen = dispatch.lookup(name, x)
        assert isinstance(getattr(chosen, "__self__", None), binding)
        dispatch.set_cpu_kernels_enabled(False)
        assert dispatch.lookup(name, x) is reference
    finally:
        dispatch.set_cpu_kernels_enabled(before)
    return chosen


def run_avx2_child(code: str, timeout: float = 900) -> list[str]:
    """Runs `code` in a child process under PDSERVE_CPU_ISA=avx2 (the build is chosen
    per process); the lines it printed."""
    env = {**os.environ, "PDSERVE_CPU_ISA": "avx2"}
    child = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert child.returncode == 0, child.stderr[-2000:]
    return child.stdout.strip().splitlines()


def avx2_child_result(code: str) -> dict[str, Any]:
    """The JSON object the last line `code` prints under the AVX2 build, whose build
    info it holds under "info"."""
    result = json.loads(run_avx2_child(code)[-1])
    assert result["info"].startswith("AVX2+FMA")
    return result


def packed_case(
    packed_weight: Callable[[int, int, int, int], torch.Tensor],
    qtype: int,
    m: int,
    n: int,
    k: int,
    bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A GGUF grid case's x [m, k], packed weight [n, k's blocks] and optional bias [n],
    seeded by the case (the weight by `packed_weight(qtype, n, k, seed)`)."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    return x, packed_weight(qtype, n, k, m + n + k + qtype), b


def assert_packed_is_float32_linear(
    kernels: Any, op: Any, x: torch.Tensor, w: torch.Tensor, qtype: int, b: torch.Tensor | None
) -> None:
    """`op.linear_gguf` is bit for bit the float32 C linear layer over the dequantized
    weights (a GGUF model's numbers are its float copy's), and close to the reference."""
    from pdserve.kernels.gguf_blocks import dequantize_rows, linear_gguf_ref

    y = op.linear_gguf(x, w, qtype, b)
    assert y.shape == (x.shape[0], w.shape[0]) and y.dtype == torch.float32
    assert torch.equal(y, kernels.linear(x, dequantize_rows(w, qtype), b))
    k = x.shape[1]
    torch.testing.assert_close(y, linear_gguf_ref(x, w, qtype, b), atol=1e-4 * k**0.5, rtol=1e-4)


def assert_avx2_packed_grid(module: str, alone: tuple[int, int, int, int]) -> None:
    """Under the AVX2 build (a child process: the build is per process), every case of
    `module`'s GRID over its TYPES is bit for bit the float32 linear layer of the
    dequantized weights, and the last 3 rows of the `alone` = (qtype, rows, weight rows, k)
    case alone give what the whole call gives; rows looked up (`gguf_rows`) are the
    dequantized rows."""
    qtype, m, n, k = alone
    code = (
        "import json, torch\n"
        "from pdserve.kernels import cpu_ops\n"
        "from pdserve.kernels.cpu_quantized import CpuQuantizedLinear\n"
        "from pdserve.kernels.gguf_blocks import dequantize_rows\n"
        f"from {module} import GRID, TYPES, case_tensors\n"
        "k = cpu_ops.load(); op = CpuQuantizedLinear(k)\n"
        "equal = []\n"
        "for q in TYPES:\n"
        "    for m, n, kk, b, t in GRID:\n"
        "        torch.set_num_threads(t)\n"
        "        x, w, bias = case_tensors(q, m, n, kk, b)\n"
        "        y = op.linear_gguf(x, w, q, bias)\n"
        "        equal.append(torch.equal(y, k.linear(x, dequantize_rows(w, q), bias)))\n"
        "    ids = torch.tensor([n - 1, 0, n // 2])\n"
        "    rows = op.gguf_rows(w, ids, q)\n"
        "    equal.append(torch.equal(rows, dequantize_rows(w, q)[ids]))\n"
        f"x, w, bias = case_tensors({qtype}, {m}, {n}, {k}, False)\n"
        f"alone = torch.equal(op.linear_gguf(x[-3:], w, {qtype}), "
        f"op.linear_gguf(x, w, {qtype})[-3:])\n"
        "print(json.dumps({'info': k.build_info, 'equal': equal, 'alone': alone}))\n"
    )
    result = avx2_child_result(code)
    assert result["alone"] and all(result["equal"]), result["equal"]
