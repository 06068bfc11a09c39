"""Each rank's device is a GPU its own process sees (rank r of a group of child processes
takes the r-th visible GPU; a group larger than what its process sees is refused before
any rank starts), and each rank process makes that device current before anything
touches CUDA: Triton launches, graph capture and NCCL work on the current device, not
on their tensors'. No GPU needed: the seams to torch.cuda are recorded."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import pipeline, worker
from pdserve.engine.config import EngineConfig
from pdserve.engine.executor import InProcessExecutor
from pdserve.engine.ranks import ProcessRanks, RankJob
from pdserve.engine.worker_group import WorkerGroupExecutor, run_rank


class _Stop(Exception):
    """Ends the code under test where the test has seen what it needs."""


def started_devices(config: EngineConfig, visible: str, monkeypatch) -> list[str]:
    """The devices a worker group of child processes hands its ranks, in a process whose
    CUDA_VISIBLE_DEVICES is `visible`."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    jobs: list[RankJob] = []

    def start(self, started):
        jobs.extend(started)
        raise _Stop

    monkeypatch.setattr(ProcessRanks, "start", start)
    with pytest.raises(_Stop):
        WorkerGroupExecutor(config).load()
    return [job.config.device for job in jobs]


@pytest.mark.parametrize(
    ("visible", "tp", "pp", "device", "expected"),
    [
        ("0,1,2", 3, 1, "cuda", ["cuda:0", "cuda:1", "cuda:2"]),
        ("4,5,6,7,8,9", 3, 2, "cuda", [f"cuda:{r}" for r in range(6)]),
        ("0,1", 1, 2, "cuda", ["cuda:0", "cuda:1"]),
        ("0,1,2,3", 3, 1, "cuda:1", ["cuda:1", "cuda:2", "cuda:3"]),  # from the one named
    ],
)  # fmt: skip
def test_a_group_of_child_processes_takes_the_gpus_its_process_sees(
    visible: str, tp: int, pp: int, device: str, expected: list[str], monkeypatch
) -> None:
    config = EngineConfig(device=device, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert started_devices(config, visible, monkeypatch) == expected


@pytest.mark.parametrize(
    ("visible", "device", "message"),
    [("7", "cuda", "3 ranks need 3 GPUs from cuda:0; this process sees 1"),
     ("0,1,2,3", "cuda:2", "3 ranks need 3 GPUs from cuda:2; this process sees 4"),
     ("", "cuda", "3 ranks need 3 GPUs from cuda:0; this process sees 0")],
)  # fmt: skip
def test_more_ranks_than_visible_gpus_are_refused_before_any_rank_starts(
    visible: str, device: str, message: str, monkeypatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(ProcessRanks, "start", lambda self, jobs: pytest.fail("a rank started"))
    with pytest.raises(ValueError, match=message) as refused:
        WorkerGroupExecutor(EngineConfig(device=device, tensor_parallel_size=3)).load()
    assert "\n" not in str(refused.value)


def test_cpu_ranks_stay_on_cpu(monkeypatch) -> None:
    config = EngineConfig(device="cpu", tensor_parallel_size=3)
    assert started_devices(config, "", monkeypatch) == ["cpu"] * 3


def recorded_calls(monkeypatch) -> list[tuple]:
    calls: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set", device)))
    return calls


@pytest.mark.parametrize(("device", "current"), [("cuda:1", "cuda:1"), ("cpu", None)])
def test_a_rank_process_makes_its_device_current_before_it_joins_the_group(
    device: str, current: str | None, monkeypatch
) -> None:
    calls = recorded_calls(monkeypatch)

    def join_group(config, rank, master, timeout_s):  # the first thing that may touch CUDA
        calls.append(("join", config.device))
        raise _Stop

    monkeypatch.setattr(pipeline, "join_group", join_group)
    job = RankJob(EngineConfig(device=device, tensor_parallel_size=2), 1, 2, "127.0.0.1:1")
    with pytest.raises(_Stop):
        run_rank(job, channel=None)  # type: ignore[arg-type]  # never reached
    made_current = [("set", torch.device(current))] if current else []
    assert calls == [*made_current, ("join", device)]


@pytest.mark.parametrize(("device", "current"), [("cuda:1", "cuda:1"), ("cuda", "cuda:0")])
def test_a_rank_in_the_drivers_process_makes_its_device_current_before_it_loads(
    device: str, current: str, monkeypatch
) -> None:
    calls = recorded_calls(monkeypatch)

    class Worker:
        def __init__(self, config, connector) -> None:
            calls.append(("worker", config.device))

        def load(self):
            calls.append(("load",))
            return "info"

    monkeypatch.setattr(worker, "ModelWorker", Worker)
    assert InProcessExecutor(EngineConfig(device=device)).load() == "info"
    assert calls == [("set", torch.device(current)), ("worker", device), ("load",)]
