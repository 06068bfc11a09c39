"""A worker group's driver counts the frames its rank processes dropped, which come with
each rank's `StepResult`, in its own process's book (the one an instance ships to the
gateway's `/metrics`). The ranks here are canned: they answer every plan at once."""

from __future__ import annotations

import threading

import msgspec

from pdserve.common.frame_drops import DROPS
from pdserve.common.messages import DroppedFrames
from pdserve.engine.config import EngineConfig
from pdserve.engine.ranks import RankJob
from pdserve.engine.step_plan import KVGeometry, StepPlan, StepResult, WorkerInfo
from pdserve.engine.worker_group import WorkerGroupExecutor

INFO = WorkerInfo(
    model_path="embedded", vocab_size=100, max_model_len=64, eos_token_ids=[0],
    generation_defaults={}, kernels="canned",
    kv=KVGeometry(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16,
                  dtype="float32", num_blocks=4),
)  # fmt: skip
# What each rank's process dropped since its previous result (the same at every step).
RANK_DROPS = {
    1: [DroppedFrames("kv_control", "malformed", 2)],
    2: [DroppedFrames("kv_control", "bad_mac", 1), DroppedFrames("kv_control", "malformed", 1)],
}


class CannedGroup:
    """Ranks that reply to a plan with an empty result and their drops."""

    def __init__(self, size: int) -> None:
        self.replies: list[tuple[int, bytes]] = [
            (rank, b"K" + msgspec.msgpack.encode(INFO)) for rank in range(size)
        ]
        self.closed = threading.Event()

    def send(self, rank: int, data: bytes) -> None:
        if data[:1] == b"P":
            result = StepResult(dropped_frames=RANK_DROPS.get(rank, []))
            self.replies.append((rank, b"K" + msgspec.msgpack.encode(result)))

    def receive(self, waiting: set[int]) -> list[tuple[int, bytes]]:
        ready = [(rank, data) for rank, data in self.replies if rank in waiting]
        self.replies = [r for r in self.replies if r[0] not in waiting]
        return ready

    def wait_for_death(self) -> tuple[int, str] | None:
        self.closed.wait()
        return None

    def pids(self) -> list[int | None]:
        return []

    def close(self, timeout_s: float) -> None:
        self.closed.set()

    def kill(self) -> None:
        self.closed.set()


class CannedRanks:
    def master_host(self) -> str:
        return "127.0.0.1"

    def devices(self, size: int, device: str) -> list[str]:
        return ["cpu"] * size

    def start(self, jobs: list[RankJob]) -> CannedGroup:
        return CannedGroup(len(jobs))


def test_the_driver_counts_what_its_rank_processes_dropped() -> None:
    executor = WorkerGroupExecutor(EngineConfig(tensor_parallel_size=3), launcher=CannedRanks())
    executor.load()
    before = DROPS.totals()
    try:
        for _ in range(2):
            executor.execute(StepPlan())
    finally:
        executor.shutdown()
    after = DROPS.totals()
    grown = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    assert grown == {("kv_control", "malformed"): 6, ("kv_control", "bad_mac"): 2}
