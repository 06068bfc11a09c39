"""Disaggregated serving with pipeline stages on both sides (local processes, a tiny
random Qwen3 with 2 layers and 4 KV heads): P at TP=2 × PP=2 hands each stage's layers,
head slice by head slice, to the same stage of D at TP=1 × PP=2; greedy text and
logprobs equal the single-process engine's and both sides count the same KV bytes."""

from __future__ import annotations

import re

import pytest

from pdserve.scheduler.sampling_params import SamplingParams
from tests.cluster.serving import LOCAL, served
from tests.engine.test_tensor_parallel import qwen3

pytestmark = pytest.mark.slow
__all__ = ["qwen3"]  # the tiny random Qwen3 fixture, shared with the engine's TP tests

PROMPTS = [[5, 17, 300, 42, 7], list(range(100, 140))]  # ids: the model's vocabulary is 1001
MAX_TOKENS = 8


def _metric(text: str, name: str, role: str) -> float:
    pattern = rf'^pdserve:{name}{{[^}}]*role="{role}"[^}}]*}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))


def test_pp2_prefill_and_decode_serve_the_single_engines_text_and_logprobs(qwen3) -> None:
    from pdserve import LLM

    llm = LLM(model=qwen3, dtype="float32", num_threads=1, kv_cache_memory=16 << 20,
              max_model_len=256)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True)
    offline = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    args = (
        *LOCAL, "--model", qwen3, "--num-prefill", "1", "--num-decode", "1",
        "--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "256",
        "-pp", "2", "--prefill-tensor-parallel-size", "2",
    )  # fmt: skip
    with served(*args, clean=True) as server:
        client = server.openai()
        for prompt, want in zip(PROMPTS, offline, strict=True):
            result = client.completions.create(
                model=qwen3, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            choice = result.choices[0]
            assert choice.text == want.text, prompt
            got = choice.logprobs.token_logprobs
            expected = [lp.logprob for lp in want.logprobs]
            assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-3
        metrics = server.get("/metrics").text
        # Every prompt block (1 + 3), all 2 layers and 4 KV heads, float32, pulled once.
        block = 2 * 2 * 4 * 16 * 16 * 4
        assert _metric(metrics, "kv_transfer_bytes_total", "decode") == 4 * block
        assert _metric(metrics, "kv_transfer_bytes_total", "prefill") == 4 * block
        assert _metric(metrics, "kv_transfer_failures_total", "decode") == 0
        assert _metric(metrics, "kv_transfer_recomputed_requests_total", "decode") == 0
