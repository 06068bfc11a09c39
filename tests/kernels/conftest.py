"""Run the Triton kernels on CPU through Triton's interpreter.

Triton decides between compiling and interpreting when `@triton.jit` runs (it reads
TRITON_INTERPRET then), so the variable must be set before the `kernels.triton_*`
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
    "kernels.triton_common",
    "kernels.triton_kv_write",
    "kernels.triton_decode",
    "kernels.triton_prefill",
    "kernels.triton_norm",
    "kernels.triton_rotary",
    "kernels.triton_ops",
]
for _name in _KERNEL_MODULES:
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])


@pytest.fixture(scope="module")
def kernels():
    """The CPU C kernels, built if needed (skips only where no C compiler exists)."""
    from kernels import cpu_build, cpu_ops

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
