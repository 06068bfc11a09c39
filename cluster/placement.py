"""Where each instance runs: its share of the cores and, on a GPU machine, its device.

CPU: each instance gets max(1, cores // instances) torch threads, pinned to disjoint
cores when every instance has at least two. GPU: with at least as many GPUs as
instances, one instance per GPU; with fewer, instances share GPUs round robin and each
gets its part of `--gpu-memory-utilization` (two on one GPU at 0.9: 0.45 each). An
instance always sees its GPU as `cuda` (device 0): the local launcher sets
CUDA_VISIBLE_DEVICES to the GPU's id, Ray does the same for an actor that asks for
`num_gpus`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass, replace

DEVICES = ("auto", "cpu", "cuda")


class PlacementError(ValueError):
    """The instances cannot be placed as asked; the message is one line."""


@dataclass(frozen=True)
class PlannedInstance:
    instance_id: str
    role: str
    num_threads: int
    cpus: list[int]  # empty: not pinned
    num_cpus: float  # Ray resource request
    device: str = "cpu"  # "cpu" or "cuda" (the one GPU the instance sees)
    gpu: str | None = None  # CUDA_VISIBLE_DEVICES id on this machine; None: CPU
    num_gpus: float = 0.0  # Ray resource request
    gpu_memory_utilization: float = 0.0  # this instance's share of its GPU's memory


def available_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def available_gpus(environ: dict[str, str] | None = None) -> list[str]:
    """The ids of this machine's visible GPUs: CUDA_VISIBLE_DEVICES when set, else what
    `nvidia-smi -L` lists (no torch import: the gateway process never loads it)."""
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [part.strip() for part in visible.split(",") if part.strip()]
        # CUDA stops at the first invalid entry; "-1" is the usual "no GPU".
        return ids[: ids.index("-1")] if "-1" in ids else ids
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if listed.returncode != 0:
        return []
    gpu_lines = [line for line in listed.stdout.splitlines() if line.startswith("GPU ")]
    return [str(i) for i in range(len(gpu_lines))]


def resolve_device(device: str, gpus: list[str]) -> str:
    """`device` is one of DEVICES (the flag's choices)."""
    if device == "auto":
        return "cuda" if gpus else "cpu"
    if device == "cuda" and not gpus:
        raise PlacementError(
            "--device cuda: no GPU visible (CUDA_VISIBLE_DEVICES, nvidia-smi); use --device cpu"
        )
    return device


def place(roles: list[str], cores: list[int], threads: int = 0) -> list[PlannedInstance]:
    """Threads and cores per instance; with at least two cores each they are pinned to
    disjoint cores (fewer would starve the gateway)."""
    count, num_cores = len(roles), len(cores)
    share = threads or max(1, num_cores // count)
    pin = not threads and num_cores // count >= 2
    seen: dict[str, int] = {}
    planned = []
    for i, role in enumerate(roles):
        index = seen[role] = seen.get(role, -1) + 1
        cpus = cores[i * share : (i + 1) * share] if pin else []
        num_cpus = min(float(share), num_cores / count)
        planned.append(PlannedInstance(f"{role}-{index}", role, share, cpus, num_cpus))
    return planned


def place_on_gpus(
    instances: list[PlannedInstance], gpus: list[str], utilization: float
) -> list[PlannedInstance]:
    """One GPU per instance while there are enough; otherwise round robin, each sharer
    with an equal part of the GPU (Ray resource and memory budget)."""
    if not gpus:
        raise PlacementError("no GPU to place instances on")
    assigned = [gpus[i % len(gpus)] for i in range(len(instances))]
    sharers = Counter(assigned)
    return [
        replace(
            planned,
            device="cuda",
            gpu=gpu,
            num_gpus=1.0 / sharers[gpu],
            gpu_memory_utilization=utilization / sharers[gpu],
        )
        for planned, gpu in zip(instances, assigned, strict=True)
    ]


def load_waves(instances: list[PlannedInstance]) -> list[list[PlannedInstance]]:
    """Groups that may load at the same time. Instances sharing a GPU load one after
    another: each sizes its KV cache from the memory the device has free, which a
    neighbour loading at the same moment would make look smaller than it is."""
    waves: list[list[PlannedInstance]] = []
    loaded_on: Counter[str | None] = Counter()
    for planned in instances:
        wave = loaded_on[planned.gpu] if planned.gpu is not None else 0
        loaded_on[planned.gpu] += 1
        while len(waves) <= wave:
            waves.append([])
        waves[wave].append(planned)
    return waves
