"""Model detail on the ranks (CPU): the forward is timed around the model call, in the
driver's process and on a pipeline group's sampling rank, and each request is charged
the steps it was part of; without it nothing is timed."""

from __future__ import annotations

import pytest

from pdserve.common.messages import InstanceTimings, RequestDelta
from pdserve.common.sampling_params import SamplingParams
from tests.engine.test_tensor_parallel import PROMPTS, _llm, qwen3

__all__ = ["qwen3"]  # the tiny random Qwen3 fixture (2 layers), shared


def timings_of(llm, prompts: list[list[int]]) -> list[InstanceTimings]:
    """Each request's timings, from the engine's last delta of it."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(engine.make_request(f"r{index}", prompt, params))
    last: dict[str, RequestDelta] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            last[delta.request_id] = delta
    found = [last[f"r{i}"].timings for i in range(len(prompts))]
    assert all(t is not None for t in found)
    return [t for t in found if t is not None]


def assert_charged(timings: InstanceTimings) -> None:
    prefill, [decode] = timings.prefill_model, timings.decode_model
    assert prefill is not None and prefill.forward is not None and decode.forward is not None
    assert timings.first_scheduled and timings.first_token and timings.last_token
    assert 0 < prefill.forward <= prefill.execute <= timings.first_token - timings.first_scheduled
    assert 0 < decode.forward <= decode.execute <= timings.last_token - timings.first_token


def test_one_rank_in_process_times_its_forward(qwen3) -> None:
    llm = _llm(qwen3, 1, collect_model_time=True)
    for timings in timings_of(llm, PROMPTS):
        assert_charged(timings)
    llm.engine.shutdown()
    off = _llm(qwen3, 1)
    assert all(t.prefill_model is None and t.decode_model == [] for t in timings_of(off, PROMPTS))
    off.engine.shutdown()


@pytest.mark.slow
def test_a_pipeline_groups_sampling_rank_times_its_forward(qwen3) -> None:
    llm = _llm(qwen3, 1, pipeline_parallel_size=2, collect_model_time=True)
    for timings in timings_of(llm, PROMPTS):
        assert_charged(timings)
    llm.engine.shutdown()
