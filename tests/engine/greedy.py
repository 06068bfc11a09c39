"""Greedy generation on an EngineCore driven step by step, shared by engine tests."""

from __future__ import annotations

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core import EngineCore


def greedy_tokens(
    engine: EngineCore, prompts: list[list[int]], max_tokens: int, max_steps: int = 500
) -> dict[str, list[int]]:
    """Adds the prompts as requests r0, r1, ... and steps until all finish (or
    `max_steps`); returns each request's tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(engine.make_request(f"r{i}", prompt, params))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for delta in engine.step():
            tokens[delta.request_id] += delta.new_token_ids
    return tokens
