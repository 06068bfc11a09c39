"""The device check imports on a CPU machine and refuses cleanly without CUDA."""

from __future__ import annotations

import pytest

from tests.experiments.without_cuda import run_without_cuda


@pytest.mark.slow
def test_gpu_check_reports_no_cuda_in_one_line():
    # Importing the kernel half first proves every import of the device script resolves.
    code = (
        "import experiments.gpu_kernels, runpy\n"
        "runpy.run_module('experiments.gpu_check', run_name='__main__')\n"
    )
    done = run_without_cuda(code, timeout_s=120)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "gpu_check: no CUDA device available (torch.cuda.is_available() is False); "
        "run it on a GPU machine"
    ]
