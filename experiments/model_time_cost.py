"""What model detail (`--collect-detailed-traces model`) costs an instance: charging one
step to its requests (the driver's part, without a model), and whole decode steps of the
embedded model on CPU with it off and on (two engines, their rounds interleaved).

    PYTHONPATH=. python -m experiments.model_time_cost [--steps 64] [--batch 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from pdserve.common.request import Request
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.core import EngineCore
from pdserve.scheduler.outputs import ScheduledChunk, SchedulerOutput

CHARGES = 20_000


def charge_cost(batch: int) -> float:
    """µs to charge one step to `batch` decoding requests (the median of CHARGES)."""
    requests = [Request(f"r{i}", [1, 2, 3], SamplingParams()) for i in range(batch)]
    for request in requests:
        request.first_token_time = 0.0
    output = SchedulerOutput([ScheduledChunk(r, 3, 1, [0]) for r in requests])
    samples = []
    for _ in range(CHARGES):
        began = time.perf_counter()
        EngineCore._charge_model_time(output, 0.001, 0.002)
        samples.append(time.perf_counter() - began)
    return statistics.median(samples) * 1e6


def engine(model_time: bool) -> EngineCore:
    config = EngineConfig(
        collect_model_time=model_time, kv_cache_memory=64 << 20, max_model_len=512, num_threads=1
    )
    return EngineCore(config)


def decode_steps(core: EngineCore, steps: int, batch: int, round_: int) -> list[float]:
    """Seconds of each decode step of `batch` requests, after their prefill."""
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [(round_ * 101 + i * 7 + k) % 1000 + 10 for k in range(16)]
        core.add_request(core.make_request(f"{round_}-{i}", prompt, params))
    core.step()  # the prompts
    times = []
    while core.has_unfinished_requests():
        began = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - began)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for batch in (1, 8, 64):
        print(f"charging a step to {batch} requests: {charge_cost(batch):.2f} us")
    engines = {False: engine(False), True: engine(True)}
    steps: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(args.rounds):
        for on, core in engines.items():
            steps[on].extend(decode_steps(core, args.steps, args.batch, round_))
    for on, times in steps.items():
        label = "on " if on else "off"
        print(
            f"model detail {label}: decode step of {args.batch} median "
            f"{statistics.median(times) * 1e3:.3f} ms over {len(times)} steps"
        )
    for core in engines.values():
        core.shutdown()


if __name__ == "__main__":
    main()
