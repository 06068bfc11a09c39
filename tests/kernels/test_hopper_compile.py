"""Every Triton kernel compiles to an sm_90 cubin without a GPU.

The interpreter tests prove the numerics; this proves the same code is valid Triton for
the real compiler (a kernel that only works in the interpreter fails here). It runs in
a subprocess: this test session imported the kernels in interpreter mode.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import triton

REPO = Path(__file__).resolve().parents[2]
KERNELS = [
    "write_kv_cache_kernel",
    "decode_attention_kernel",
    "merge_partitions_kernel",
    "prefill_attention_kernel",
    "rms_norm_kernel",
    "rotary_embedding_kernel",
]


@pytest.mark.slow
def test_every_kernel_compiles_for_hopper(tmp_path):
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    assert ptxas.exists(), f"the triton wheel ships no ptxas at {ptxas}"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a cold cache: ptxas really runs
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernels.hopper_compile"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = re.search(r"compiled (\d+)/(\d+) variants of 6 kernels", done.stdout)
    assert summary and summary[1] == summary[2], done.stdout
    for kernel in KERNELS:
        assert re.search(rf"^ok +{kernel} ", done.stdout, re.M), f"{kernel} not compiled"
