"""A CPU worker's malloc thresholds: a prefill step's big buffers are reused from the
heap, not mapped, faulted and zeroed again every layer (engine/host_memory.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# A child process frees and allocates layer-sized float32 buffers (a 2048-token chunk's
# MLP input of SmolLM2 is 25 MB) and reports the page faults of the later rounds.
CHILD = """
import json, resource, sys, torch
from pdserve.engine.host_memory import keep_buffers_mapped
took = keep_buffers_mapped() if sys.argv[1] == "on" else None
def layer():
    bufs = [torch.empty(2048 * 3072) for _ in range(3)]
    for b in bufs:
        b.fill_(1.0)
for _ in range(3):
    layer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    layer()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"took": took, "faults": faults}))
"""


def run_child(setting: str) -> dict:
    child = subprocess.run(
        [sys.executable, "-c", CHILD, setting], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr[-2000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_step_buffers_are_reused_instead_of_faulted_again():
    on, off = run_child("on"), run_child("off")
    assert on["took"] is True
    # 10 rounds of 3 x 24 MiB would fault ~18,000 pages if remapped each time.
    assert on["faults"] < 1000, on
    assert off["faults"] > 5 * max(on["faults"], 100), (on, off)
