"""Prompt logprobs on the engine: every prompt token but the first scored once, with the
first output token, whatever the chunking and the prefix cache; a prompt row scores the
same as a decode step that sampled that token (float32, CPU: the kernels are invariant)."""

from __future__ import annotations

import pytest

from pdserve.common.messages import RequestDelta
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core import EngineCore

PROMPT = [(i * 37) % 900 + 20 for i in range(41)]  # 41 ids: chunks of 16 leave a tail


def run(core: EngineCore, request_id: str, prompt: list[int], params: SamplingParams):
    core.add_request(core.make_request(request_id, prompt, params))
    deltas: list[RequestDelta] = []
    while core.has_unfinished_requests():
        deltas += core.step()
    return deltas


@pytest.fixture(scope="module")
def llm():
    """Prompts in chunks of 16 tokens; the decode steps one token each."""
    from pdserve import LLM

    return LLM(
        dtype="float32", num_threads=1, num_kv_blocks=64, max_model_len=256,
        max_num_batched_tokens=16,
    )  # fmt: skip


def test_prompt_logprobs_come_once_and_equal_the_decode_steps_that_sampled_them(llm) -> None:
    core = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)
    generated = run(core, "gen", PROMPT, greedy)
    continuation = [d.new_token_ids[0] for d in generated]
    sampled = [d.logprobs[0].logprob for d in generated]
    scoring = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    prompt = PROMPT + continuation
    for request_id in ("first", "again"):  # again: the prompt's blocks are in the cache
        deltas = run(core, request_id, prompt, scoring)
        assert [d.prompt_logprobs is not None for d in deltas] == [True, False]
        scored = deltas[0].prompt_logprobs
        assert len(scored) == len(prompt) - 1  # tokens 1..n-1: the first has none
        assert [s.token_id for s in scored] == prompt[1:]
        assert all(len(s.top_ids) == 2 and s.rank >= 1 for s in scored)
        tail = scored[-len(continuation) :]
        assert [s.rank for s in tail] == [1] * len(continuation)  # greedy picks
        assert [s.logprob for s in tail] == pytest.approx(sampled, abs=1e-5)
        if request_id == "first":
            first = [s.logprob for s in scored]
        else:
            assert [s.logprob for s in scored] == first
    plain = run(core, "plain", PROMPT, SamplingParams(temperature=0.0, max_tokens=1))
    assert plain[0].prompt_logprobs is None
    one = run(core, "one", PROMPT[:1], scoring)
    assert one[0].prompt_logprobs == []
    # The offline LLM returns them as vLLM's does: one per prompt token, the first None.
    (out,) = llm.generate([{"prompt_token_ids": prompt}], scoring)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    assert [s.logprob for s in out.prompt_logprobs[1:]] == first
