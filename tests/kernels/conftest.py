"""Run the Triton kernels on CPU through Triton's interpreter.

Triton decides between compiling and interpreting when `@triton.jit` runs (it reads
TRITON_INTERPRET then), so the variable must be set before any `kernels.triton_*`
module is imported; pytest loads this file before collecting the tests beside it.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
