"""Per-step overhead of a worker group's channel: ranks as child processes with a pipe
each (`engine/ranks.py:ProcessRanks`) against ranks as Ray actors with a sealed ZMQ
socket each (`cluster/ray_ranks.py:RayRanks`).

    python -m experiments.ray_rank_channel [--tp 3] [--steps 300]

The embedded model at TP=3, one torch thread per rank. A step with no chunks still
crosses the whole path (plan encoded, sent to every rank, decoded there, an empty
`StepResult` encoded and sent back, gathered), so its round trip is what the channel
adds to every real step. A local Ray cluster (2 CPUs) is started for the Ray side. For
comparison, the other way a Ray rank could be talked to: one Ray call per rank and step
carrying the same bytes (echo actors that do nothing else).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import msgspec

from pdserve.engine.config import EngineConfig
from pdserve.engine.ranks import RankLauncher
from pdserve.engine.step_plan import StepPlan
from pdserve.engine.worker_group import WorkerGroupExecutor


def round_trips(launcher: RankLauncher | None, tp: int, steps: int) -> list[float]:
    config = EngineConfig(
        tensor_parallel_size=tp, num_threads=tp, dtype="float32",
        kv_cache_memory=32 << 20, max_model_len=512,
    )  # fmt: skip
    executor = WorkerGroupExecutor(config, launcher=launcher)
    executor.load()
    try:
        plan = StepPlan(finished_ids=[f"done-{i}" for i in range(4)])  # a few ids, as usual
        for _ in range(20):  # warm up
            executor.execute(plan)
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            executor.execute(plan)
            times.append(time.perf_counter() - started)
        return times
    finally:
        executor.shutdown()


class Echo:
    def echo(self, message: bytes) -> bytes:
        return message


def ray_call_round_trips(ray, tp: int, steps: int) -> list[float]:
    actors = [ray.remote(Echo).options(num_cpus=0).remote() for _ in range(tp)]
    message = b"P" + msgspec.msgpack.encode(StepPlan(finished_ids=[f"done-{i}" for i in range(4)]))
    times = []
    for i in range(20 + steps):
        started = time.perf_counter()
        ray.get([actor.echo.remote(message) for actor in actors])
        if i >= 20:
            times.append(time.perf_counter() - started)
    for actor in actors:
        ray.kill(actor)
    return times


def describe(name: str, times: list[float]) -> str:
    ms = sorted(t * 1e3 for t in times)
    p90 = ms[int(len(ms) * 0.9)]
    return f"{name}: median {statistics.median(ms):.3f} ms, p90 {p90:.3f} ms ({len(ms)} steps)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    pipes = round_trips(None, args.tp, args.steps)
    print(describe(f"pipes, TP={args.tp}", pipes), flush=True)

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from pdserve.cluster.ray_cluster import ray_module
    from pdserve.cluster.ray_ranks import RayRanks, reserve_rank_groups

    ray = ray_module()
    ray.init(num_cpus=2, logging_level="ERROR")
    try:
        bundle = {"CPU": 2 / args.tp}  # as the launcher splits an instance's CPUs
        groups = reserve_rank_groups("bench", args.tp, 1, bundle, 60)
        actors = round_trips(RayRanks("127.0.0.1", "bench"), args.tp, args.steps)
        calls = ray_call_round_trips(ray, args.tp, args.steps)
        for group in groups:
            ray.util.remove_placement_group(group)
    finally:
        ray.shutdown()
    print(describe(f"Ray actors + sealed ZMQ, TP={args.tp}", actors))
    print(describe(f"Ray calls carrying the bytes (echo only), TP={args.tp}", calls))
    ratio = statistics.median(actors) / statistics.median(pipes)
    print(f"ratio of medians (Ray actors + ZMQ / pipes): {ratio:.2f}x")


if __name__ == "__main__":
    main()
