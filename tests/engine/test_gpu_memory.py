"""KV cache sizing on a GPU shared by several instances (`engine/gpu_memory.py`)."""

from __future__ import annotations

import fcntl
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import pytest
import torch

from pdserve.engine import gpu_memory
from pdserve.engine.gpu_memory import GiB, MemoryProfile, kv_cache_bytes, sizing_turn

Turn = Callable[[], AbstractContextManager[None]]
TOTAL = 140 * GiB
WEIGHTS = GiB // 8


class SharedGpu:
    """A device's free memory, which every process's allocations lower."""

    def __init__(self) -> None:
        self.free = TOTAL - GiB  # contexts already there
        self.lock = threading.Lock()

    def allocate(self, size: int) -> None:
        with self.lock:
            self.free -= size


def size_one_instance(gpu: SharedGpu, turn: Turn, loaded: threading.Event) -> int:
    """What `ModelWorker.load` does on CUDA: a baseline, the weights, the profile."""
    with turn():
        free_before_load = gpu.free
        gpu.allocate(WEIGHTS)
        loaded.set()
        time.sleep(0.3)  # loading and profiling take a while; others start meanwhile
        used_since_baseline = free_before_load - gpu.free
        profile = MemoryProfile(
            total=TOTAL, free=gpu.free, weights=WEIGHTS, activation_peak=0,
            non_torch=max(0, used_since_baseline - WEIGHTS),
        )  # fmt: skip
        return kv_cache_bytes(profile, utilization=0.05)


def start_beside(gpu: SharedGpu, turn: Turn) -> tuple[threading.Event, threading.Thread]:
    """Another instance on the same GPU that starts once the first has begun loading."""
    loaded = threading.Event()

    def other_instance() -> None:
        loaded.wait(5)
        with turn():
            gpu.allocate(14 * GiB)  # its weights and KV cache

    thread = threading.Thread(target=other_instance)
    thread.start()
    return loaded, thread


def test_an_instance_starting_beside_another_does_not_count_its_memory(monkeypatch, tmp_path):
    # Seen on an H200: three servers' five instances started on one GPU at once, and one
    # refused to start, counting 14.47 GiB of the others' memory as its own.
    monkeypatch.setattr(gpu_memory.tempfile, "gettempdir", lambda: str(tmp_path))
    gpu = SharedGpu()
    turn = lambda: sizing_turn(torch.device("cuda", 0))  # noqa: E731
    loaded, other = start_beside(gpu, turn)
    try:
        kv_bytes = size_one_instance(gpu, turn, loaded)
    finally:
        other.join(5)
    assert kv_bytes == int(TOTAL * 0.05) - WEIGHTS
    assert gpu.free == TOTAL - GiB - WEIGHTS - 14 * GiB  # the other one did start, after


def test_without_turns_the_other_instance_is_counted():
    """The failure the turn prevents, shown by taking the turn away."""
    gpu = SharedGpu()
    loaded, other = start_beside(gpu, nullcontext)
    with pytest.raises(ValueError, match=r"other 14\.00 GiB"):
        size_one_instance(gpu, nullcontext, loaded)
    other.join(5)


def test_the_turn_is_one_per_physical_gpu(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_memory.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert gpu_memory.physical_gpu(torch.device("cuda", 1)) == "5"
    with sizing_turn(torch.device("cuda", 1)):
        assert turn_is_held(gpu_memory.sizing_lock_path(torch.device("cuda", 1)))
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")  # another process's view of GPU 5
        assert turn_is_held(gpu_memory.sizing_lock_path(torch.device("cuda", 0)))
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
        assert not turn_is_held(gpu_memory.sizing_lock_path(torch.device("cuda", 0)))


def turn_is_held(path) -> bool:
    """Whether some other open file holds the turn's lock."""
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False
