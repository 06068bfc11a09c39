"""Registration of the Triton kernels and the lazy, fail-safe import of triton."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.kernels import dispatch, reference

REPO = Path(__file__).resolve().parents[2]


def _python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_kernels_import_without_triton_and_fall_back_with_a_reason():
    # One interpreter (imports are slow on a busy machine) checks both: importing
    # kernels leaves triton alone, and with triton missing CUDA calls keep the references.
    code = (
        "import sys\n"
        "import pdserve.kernels as kernels\n"
        "assert 'triton' not in sys.modules, 'importing kernels imported triton'\n"
        "sys.modules['triton'] = None\n"
        "from pdserve.kernels import dispatch\n"
        "assert dispatch.load_triton_kernels() is False\n"
        "print(kernels.triton_unavailable_reason())\n"
    )
    done = _python(code)
    assert done.returncode == 0, done.stderr
    assert "triton kernels unavailable" in done.stdout
    assert "torch references" in done.stdout


def test_loading_registers_every_kernel_and_cpu_never_runs_triton():
    assert dispatch.load_triton_kernels()
    assert dispatch.triton_unavailable_reason() is None
    from pdserve.kernels.triton_ops import TRITON_KERNELS

    # The linear layer has no Triton kernel: on CUDA its reference is cuBLAS already;
    # the int8 and GGUF-block ones, and the GGUF row lookup, serve CPUs only (both kinds
    # of weight are refused on CUDA), as does the lanes layout (packed on CPU only).
    cpu_only = {"linear", "linear_int8", "linear_gguf", "gguf_rows", "linear_lanes"}
    assert set(TRITON_KERNELS) == set(dispatch._REFERENCE) - cpu_only
    for name, fn in TRITON_KERNELS.items():
        assert dispatch._TRITON[name] is fn
        assert dispatch.lookup(name, torch.zeros(1)) is not fn
    # The stand-alone rotary has no C kernel (models run it fused with the KV write).
    assert dispatch.lookup("rotary_embedding", torch.zeros(1)) is reference.rotary_embedding_ref
    assert dispatch.lookup("rms_norm", torch.zeros(1)) is not reference.rms_norm_ref
