"""How many KV blocks fit on a CUDA device (`--gpu-memory-utilization`).

As vLLM does: the engine may use `utilization` x the device's memory. From that it
subtracts the weights, the peak of activation memory in a profiled step of the largest
batch (`max_num_batched_tokens` prompt tokens, logits and sampler work for
`max_num_seqs` rows), and the memory this process holds outside torch's allocator
(CUDA context growth, cuBLAS workspaces), measured since before the weights loaded.
The rest is the KV cache, bounded by what the device still has free. CUDA graphs take
their (small) pool from the headroom left by `utilization` < 1.

The memory outside torch can only be read device-wide (free memory), so instances that
share a GPU size their caches in turn (`sizing_turn`): otherwise another instance's
weights and cache, allocated while this one loads, would count as this one's.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pdserve.engine.kv_cache import KVCache, KVCacheShape
from pdserve.engine.step_inputs import build_step_inputs, contiguous_block_tables, inputs_on

if TYPE_CHECKING:
    from pdserve.engine.models.llama import LlamaForCausalLM

GiB = 1 << 30
# Slack kept free on the device beyond the budget (allocator fragmentation).
FREE_MEMORY_MARGIN = 256 << 20


@dataclass(frozen=True)
class MemoryProfile:
    total: int  # bytes of device memory
    free: int  # bytes free on the device after profiling (other processes included)
    weights: int  # bytes torch holds for the model
    activation_peak: int  # peak bytes above the weights during the profiled step
    non_torch: int  # bytes this process gained outside torch's allocator since the baseline


def kv_cache_bytes(profile: MemoryProfile, utilization: float) -> int:
    """The KV cache's share of the device; raises if nothing is left for it."""
    budget = (
        int(profile.total * utilization)
        - profile.weights
        - profile.activation_peak
        - profile.non_torch
    )
    available = min(budget, profile.free - FREE_MEMORY_MARGIN)
    if available <= 0:
        raise ValueError(
            f"gpu_memory_utilization {utilization} of {profile.total / GiB:.1f} GiB leaves no "
            f"room for the KV cache (weights {profile.weights / GiB:.2f} GiB, activations "
            f"{profile.activation_peak / GiB:.2f} GiB, other {profile.non_torch / GiB:.2f} GiB, "
            f"free {profile.free / GiB:.2f} GiB); raise --gpu-memory-utilization or lower "
            "--max-num-batched-tokens"
        )
    return available


def physical_gpu(device: torch.device) -> str:
    """The GPU behind `device` as every process names it: its entry in
    CUDA_VISIBLE_DEVICES (an index or a UUID), else its index."""
    index = device.index or 0
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    visible = [v for v in visible if v]
    return visible[index] if index < len(visible) else str(index)


def sizing_lock_path(device: torch.device) -> Path:
    return Path(tempfile.gettempdir()) / f"pdserve-gpu-{physical_gpu(device)}.sizing.lock"


@contextmanager
def sizing_turn(device: torch.device) -> Iterator[None]:
    """This GPU's turn to load, profile and allocate a KV cache, one process at a time
    (an flock: a process that dies mid-turn releases it)."""
    with open(sizing_lock_path(device), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def free_device_memory(device: torch.device) -> int:
    """Free bytes now (call before loading the weights: the profile's baseline)."""
    free, _ = torch.cuda.mem_get_info(device)
    return free


@torch.inference_mode()
def profile_memory(
    model: LlamaForCausalLM,
    shape: KVCacheShape,
    device: torch.device,
    free_before_load: int,
    max_num_tokens: int,
    max_num_seqs: int,
) -> MemoryProfile:
    """Runs one prefill step of `max_num_tokens` tokens on a scratch KV cache and
    measures the peak; `free_before_load` comes from `free_device_memory`."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    blocks = -(-max_num_tokens // shape.block_size)
    scratch = KVCache(shape, blocks, device)
    inputs = build_step_inputs(
        [([0] * max_num_tokens, 0)],
        contiguous_block_tables(1, blocks),
        shape.block_size,
        getattr(model, "sliding_window", None),
    )
    inputs = inputs_on(inputs, device)
    token_ids, positions, meta = inputs.token_ids, inputs.positions, inputs.meta
    torch.cuda.synchronize(device)
    before_step = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    stage = model.stage  # a later pipeline stage starts from the stage before's states
    carried = None
    if not stage.is_first:
        carried = torch.zeros(2, max_num_tokens, model.cfg.hidden_size, device=device)
        carried = carried.to(model.hidden_dtype)
    hidden = model(token_ids, positions, scratch.layers, meta, carried)
    logits = probs = ordered = None
    if stage.is_last:
        rows = min(max_num_seqs, max_num_tokens)
        logits = model.compute_logits(hidden[-rows:])
        # The sampler's worst case holds probabilities and a sorted copy with its indices.
        probs = logits.softmax(dim=-1)
        ordered = logits.sort(dim=-1, descending=True)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del hidden, logits, probs, ordered, scratch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used_since_baseline = free_before_load - free
    non_torch = max(0, used_since_baseline - torch.cuda.memory_reserved(device))
    return MemoryProfile(
        total=total,
        free=free,
        weights=weights,
        activation_peak=peak - before_step,
        non_torch=non_torch,
    )
