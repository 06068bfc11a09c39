"""Which device a rank uses, under every launcher: one GPU of its own, as its process
sees it.

CUDA numbers the GPUs a process sees (CUDA_VISIBLE_DEVICES) from 0. A worker group of W
ranks in child processes (`pdserve.LLM`, `--launcher local`) inherits its driver's view:
the local launcher shows an instance of W ranks W GPUs, and rank r takes `cuda:r` (from
N up with a group device of `cuda:N`). A rank actor under Ray asks Ray for one GPU, which
Ray alone makes visible: it takes `cuda:0`. Each rank makes its device current
(`use_device`) before anything touches CUDA: Triton launches, CUDA graph capture and
NCCL's communicators use the current device, not their tensors'.

Torch-free at import: the gateway's process plans with it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


class DeviceError(ValueError):
    """A group's ranks cannot each have a GPU of their own; the message is one line."""


def visible_gpu_ids(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The ids CUDA_VISIBLE_DEVICES lists (CUDA stops at the first invalid entry; "-1"
    is the usual "no GPU"); None when it is not set (the process sees every GPU)."""
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    ids = [part.strip() for part in visible.split(",") if part.strip()]
    return ids[: ids.index("-1")] if "-1" in ids else ids


def visible_gpu_count() -> int:
    """How many GPUs this process sees."""
    ids = visible_gpu_ids()
    if ids is not None:
        return len(ids)
    import torch

    return torch.cuda.device_count()


def cuda_index(device: str) -> int:
    """0 for "cuda", N for "cuda:N"."""
    _, _, index = device.partition(":")
    return int(index) if index else 0


def group_devices(device: str, size: int, visible: int | None = None) -> list[str]:
    """Each rank's device when all `size` ranks share one view of `visible` GPUs (None:
    this process's): rank r takes the r-th GPU from the one `device` names."""
    if device == "cpu":
        return ["cpu"] * size
    visible = visible_gpu_count() if visible is None else visible
    first = cuda_index(device)
    if first + size > visible:
        raise DeviceError(
            f"{size} ranks need {size} GPUs from cuda:{first}; this process sees {visible} "
            "(CUDA_VISIBLE_DEVICES): one GPU per rank, two ranks of a group never share one"
        )
    return [f"cuda:{first + rank}" for rank in range(size)]


def own_gpu_devices(device: str, size: int) -> list[str]:
    """Each rank's device when each rank's process sees only the GPU it was given."""
    return ["cpu" if device == "cpu" else "cuda:0"] * size


def use_device(device: str) -> None:
    """Makes a rank's GPU this process's current device (nothing on CPU)."""
    if device == "cpu":
        return
    import torch

    torch.cuda.set_device(torch.device(f"cuda:{cuda_index(device)}"))
