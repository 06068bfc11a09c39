"""Run the Triton kernels on CPU through Triton's interpreter.

Triton decides between compiling and interpreting when `@triton.jit` runs (it reads
TRITON_INTERPRET then), so the variable must be set before the `kernels.triton_*`
modules execute; pytest loads this file before collecting the tests beside it. If
tests elsewhere in the session imported them first, they are re-executed here.
"""

import importlib
import os
import sys

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
