"""Running the device check's code in a fresh Python that sees no CUDA device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_without_cuda(code: str, timeout_s: float) -> subprocess.CompletedProcess:
    """`python -c code` at the repository root with no CUDA device visible, and Triton
    left to compile as on the device (this test session interprets it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
