"""Host memory of a CPU engine: a step's big buffers stay mapped between steps.

glibc gives a freed block back to the kernel when it is over the mmap threshold, or
when the free top of the heap grows past the trim threshold (both move with use, to at
most 32 MiB and 64 MiB). A prefill chunk's activations are that big (2048 tokens of
SmolLM2's MLP input are 25 MB, and a layer frees several), so every layer of every
prefill step mapped them again and the kernel faulted and zeroed them page by page:
5-8 % of a 2000-token prefill on the 2-core VM (`BENCHMARKS.md`). With the mmap
threshold at its largest and the trim threshold far above a step's peak, they are
reused from the heap instead. A recorded decode step holds its buffers already.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the largest glibc takes (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 << 30  # far above a step's activations: the heap top is kept


def keep_buffers_mapped() -> bool:
    """Sets this process's malloc thresholds so freed step buffers are reused; True
    where it took (Linux with glibc), False elsewhere (nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:  # not glibc (musl has none)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
