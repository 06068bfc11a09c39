"""A CPU worker's malloc thresholds: a prefill step's big buffers come from the heap and
stay there when freed, instead of being mapped, faulted and zeroed again every layer
(engine/host_memory.py). Read from glibc's own books (mallinfo2) in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# A child allocates three layer-sized float32 buffers (a 2048-token chunk's MLP input of
# SmolLM2 is 25 MB), frees them, and reports glibc's mapped and heap bytes.
CHILD = """
import ctypes, json, sys, torch
from pdserve.engine.host_memory import keep_buffers_mapped

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
took = keep_buffers_mapped() if sys.argv[1] == "on" else None
before = libc.mallinfo2()
bufs = [torch.empty(2048 * 3072) for _ in range(3)]
held = libc.mallinfo2()
del bufs
after = libc.mallinfo2()
print(json.dumps({
    "took": took,
    "mapped_while_held": held.hblkhd - before.hblkhd,
    "heap_kept_after_free": after.arena - before.arena,
}))
"""
BUFFER = 2048 * 3072 * 4


def run_child(setting: str) -> dict:
    child = subprocess.run(
        [sys.executable, "-c", CHILD, setting], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr[-2000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_step_buffers_come_from_the_heap_and_stay_there():
    on, off = run_child("on"), run_child("off")
    assert on["took"] is True
    assert on["mapped_while_held"] < BUFFER, on  # none of the three was mapped alone
    assert on["heap_kept_after_free"] >= 2 * BUFFER, on  # freed, still the process's
    # glibc's defaults map a fresh process's first big buffers and unmap them when freed.
    assert off["mapped_while_held"] >= BUFFER, off
    assert off["heap_kept_after_free"] < BUFFER, off
