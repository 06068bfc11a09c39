"""The device check imports on a CPU machine and refuses cleanly without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_reports_no_cuda_in_one_line():
    # Importing the kernel half first proves every import of the device script resolves.
    code = (
        "import experiments.gpu_kernels, runpy\n"
        "runpy.run_module('experiments.gpu_check', run_name='__main__')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "gpu_check: no CUDA device available (torch.cuda.is_available() is False); "
        "run it on a GPU machine"
    ]
