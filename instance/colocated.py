"""The colocated instance kind: an ordinary engine that runs each request to the end.

It computes the prompt and every output token itself — the baseline disaggregated
serving is compared against, and the whole of `--mode colocated`.
"""

from __future__ import annotations

from pdserve.instance.loop import InstanceRuntime


class ColocatedRuntime(InstanceRuntime):
    role = "colocated"
