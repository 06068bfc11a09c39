"""What the tests of the C linear layers (float, int8, GGUF) check alike: a row's output
independent of the rest of the call, the dispatch to the C binding and back, and the
AVX2 build run in a child process."""

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
