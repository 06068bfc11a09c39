"""Where each instance runs: its share of the cores and, on a GPU machine, its GPUs.

CPU: each instance gets max(1, cores // instances) torch threads, pinned to disjoint
cores when every instance has at least two. GPU: one GPU per rank. An instance of W > 1
ranks (TP x PP) takes W whole GPUs of its own: two ranks of one group never share one
(NCCL refuses it). Single-rank instances take one GPU each of those left while there are
enough; with fewer they share them round robin, each with its part of
`--gpu-memory-utilization` (two on one GPU at 0.9: 0.45 each). The local launcher shows
an instance its GPUs in CUDA_VISIBLE_DEVICES (rank r uses the r-th); under Ray each rank
asks for one GPU (a single-rank instance for its share) and Ray makes it visible
(`engine/devices.py` says which device each rank names).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace

from pdserve.engine.devices import visible_gpu_ids

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
    device: str = "cpu"  # "cpu" or "cuda"
    gpus: tuple[str, ...] = ()  # CUDA_VISIBLE_DEVICES ids, one per rank; (): CPU
    num_gpus: float = 0.0  # Ray resource request: one per rank, or a single rank's share
    gpu_memory_utilization: float = 0.0  # this instance's share of each of its GPUs' memory


def available_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def available_gpus(environ: dict[str, str] | None = None) -> list[str]:
    """The ids of this machine's visible GPUs: CUDA_VISIBLE_DEVICES when set, else what
    `nvidia-smi -L` lists (no torch import: the gateway process never loads it)."""
    visible = visible_gpu_ids(environ)
    if visible is not None:
        return visible
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
        planned.append(
            PlannedInstance(
                instance_id=f"{role}-{index}",
                role=role,
                num_threads=share,
                cpus=cpus,
                num_cpus=num_cpus,
            )
        )
    return planned


def place_on_gpus(
    instances: list[PlannedInstance],
    gpus: list[str],
    utilization: float,
    ranks: Mapping[str, int] | None = None,
) -> list[PlannedInstance]:
    """One GPU per rank (`ranks`: TP x PP by role, 1 if absent). Instances of several
    ranks take whole GPUs first, in order; single-rank instances take one each of the
    rest while there are enough, otherwise share them round robin, each sharer with an
    equal part of the GPU (Ray resource and memory budget)."""
    if not gpus:
        raise PlacementError("no GPU to place instances on")
    sizes = [(ranks or {}).get(planned.role, 1) for planned in instances]
    check_gpus_suffice(instances, sizes, len(gpus))
    whole: dict[int, tuple[str, ...]] = {}
    taken = 0
    for index, size in enumerate(sizes):
        if size > 1:
            whole[index] = tuple(gpus[taken : taken + size])
            taken += size
    left = gpus[taken:]
    singles = [index for index, size in enumerate(sizes) if size == 1]
    shared = {index: left[k % len(left)] for k, index in enumerate(singles)}
    sharers = Counter(shared.values())
    placed = []
    for index, planned in enumerate(instances):
        own = whole.get(index)
        share = 1.0 if own else 1.0 / sharers[shared[index]]
        placed.append(
            replace(
                planned,
                device="cuda",
                gpus=own or (shared[index],),
                num_gpus=float(len(own)) if own else share,
                gpu_memory_utilization=utilization * share,
            )
        )
    return placed


def check_gpus_suffice(instances: list[PlannedInstance], sizes: list[int], count: int) -> None:
    """Every rank of a multi-rank instance needs a GPU of its own; single-rank instances
    need one GPU left to share."""
    need = sum(size for size in sizes if size > 1) + (1 if 1 in sizes else 0)
    if need <= count:
        return
    pairs = zip(instances, sizes, strict=True)
    wide = ", ".join(f"{planned.instance_id}: {size}" for planned, size in pairs if size > 1)
    raise PlacementError(
        f"the instances need {need} GPUs and {count} are there: a tensor- or pipeline-"
        f"parallel instance takes one GPU per rank ({wide}), never shared, as NCCL refuses "
        "two ranks of one group on one GPU (single-rank instances may share one)"
    )


def load_waves(instances: list[PlannedInstance]) -> list[list[PlannedInstance]]:
    """Groups that may load at the same time. Instances sharing a GPU load one after
    another: each sizes its KV cache from the memory the device has free, which a
    neighbour loading at the same moment would make look smaller than it is."""
    waves: list[list[PlannedInstance]] = []
    loaded_on: Counter[tuple[str, ...]] = Counter()
    for planned in instances:
        wave = loaded_on[planned.gpus] if planned.gpus else 0
        loaded_on[planned.gpus] += 1
        while len(waves) <= wave:
            waves.append([])
        waves[wave].append(planned)
    return waves


def pool_capacity(
    instances: list[PlannedInstance], num_cores: int, num_gpus: int
) -> dict[str, int]:
    """The default `--max-pool-size` of each role: how many instances of its first
    planned one's shape (its CPUs, and GPUs) the cores and GPUs hold, never fewer than
    planned. More could not all be placed: Ray would keep the rest pending, the local
    launcher would crowd them onto the same cores."""
    capacity: dict[str, int] = {}
    for role in dict.fromkeys(planned.role for planned in instances):
        members = [planned for planned in instances if planned.role == role]
        shape = members[0]
        fits = [num_cores / shape.num_cpus] if shape.num_cpus > 0 else []
        if shape.num_gpus > 0:
            fits.append(num_gpus / shape.num_gpus)
        fit = int(min(fits) + 1e-9) if fits else len(members)
        capacity[role] = max(len(members), fit)
    return capacity
