"""Run the Triton kernels on CPU through Triton's interpreter.

Triton decides between compiling and interpreting when `@triton.jit` runs (it reads
TRITON_INTERPRET then), so the variable must be set before the `pdserve.kernels.triton_*`
modules execute; pytest loads this file before collecting the tests beside it. If
tests elsewhere in the session imported them first, they are re-executed here.
"""

import importlib
import os
import sys

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"

_KERNEL_MODULES = [
    "pdserve.kernels.triton_common",
    "pdserve.kernels.triton_flash",
    "pdserve.kernels.triton_kv_write",
    "pdserve.kernels.triton_decode",
    "pdserve.kernels.triton_prefill",
    "pdserve.kernels.triton_norm",
    "pdserve.kernels.triton_rotary",
    "pdserve.kernels.triton_ops",
]
for _name in _KERNEL_MODULES:
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])


@pytest.fixture(scope="module")
def kernels():
    """The CPU C kernels, built if needed (skips only where no C compiler exists)."""
    from pdserve.kernels import cpu_build, cpu_ops

    try:
        return cpu_ops.load()
    except cpu_build.BuildError as exc:
        if "no C compiler" in str(exc):
            pytest.skip(f"CPU kernels need a C compiler: {exc}")
        raise


@pytest.fixture
def threads():
    """Set torch's thread count for one test, restoring it after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)
