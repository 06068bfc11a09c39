"""An FP8 KV cache's per-layer scales measured at load (`--calculate-kv-scales`).

One prefill of a fixed calibration text into a scratch cache of the model's own dtype;
each layer's k_scale (v_scale) is its largest |key| (|value|) over the text, times
`HEADROOM`, over the format's largest value: the calibration's largest entry takes half
the format's range, so keys up to twice as large as any seen still fit, and smaller ones
keep the precision that a scale of 1.0 gives away when a model's keys are large (or
spends when they are small). The text, the model and its dtype fix the scales, so every
instance of a deployment gets the same ones, which the KV handoff between instances
requires; the ranks of a tensor-parallel group take the largest over their heads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pdserve.engine.kv_cache import KVCache, KVCacheShape
from pdserve.engine.kv_scales import KVScales
from pdserve.engine.parallel import TensorParallel
from pdserve.engine.step_inputs import build_step_inputs, contiguous_block_tables, inputs_on

HEADROOM = 2.0
# Prose, a dialogue, code, JSON and digits: the kinds of text the model serves.
CALIBRATION_TEXT = """\
The river had been rising for three days when the ferry stopped running. People in the \
village gathered at the school, where the teacher kept a radio and a map of the valley. \
Nobody expected the bridge to fail; it had stood for ninety years, through floods far \
worse than this one.
User: Can you summarise the report in two sentences and list the action items?
Assistant: The audit found that 14 of 212 invoices were paid twice, costing 38,400 euros. \
Action items: recover the duplicates by March 31, add a check on invoice numbers, and \
review the vendor list every quarter.
def moving_average(values: list[float], window: int) -> list[float]:
    if window <= 0:
        raise ValueError("window must be positive")
    return [sum(values[i - window:i]) / window for i in range(window, len(values) + 1)]
{"id": 4817, "name": "sensor-07", "readings": [21.5, 21.7, 22.0, 21.9], "ok": true, \
"location": {"lat": 48.8566, "lon": 2.3522}, "tags": ["indoor", "north wing"]}
Question: A train leaves at 14:05 and arrives at 17:50. How long is the journey? \
Answer: 3 hours and 45 minutes.
In 1905 Einstein published four papers: on the photoelectric effect, Brownian motion, \
special relativity, and the equivalence of mass and energy. Each changed physics.
"""


def calculate_kv_scales(
    model: Any,
    token_ids: list[int],
    shape: KVCacheShape,
    fp8_dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel,
) -> KVScales:
    """Every model layer's scales from one prefill of `token_ids` (a whole model: the
    caller refuses pipeline stages, whose layers see another stage's states)."""
    scratch = KVCache(shape, -(-len(token_ids) // shape.block_size), device)
    tables = contiguous_block_tables(1, scratch.num_blocks)
    inputs = inputs_on(build_step_inputs([(token_ids, 0)], tables, shape.block_size), device)
    with torch.inference_mode():
        model(inputs.token_ids, inputs.positions, scratch.layers, inputs.meta)
        # [blocks, layers, 2, heads, block, dim] -> each layer's largest |key|, |value|
        largest = scratch.storage.float().abs().amax(dim=(0, 3, 4, 5))
    if tp.enabled:
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=tp.group)
    fp8_max = torch.finfo(fp8_dtype).max
    scales = (largest.cpu() * HEADROOM / fp8_max).tolist()
    # A layer that wrote only zeros keeps vLLM's default of 1.0.
    k = [s if s > 0 else 1.0 for s, _ in scales]
    v = [s if s > 0 else 1.0 for _, s in scales]
    return KVScales(k, v)
