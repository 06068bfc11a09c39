"""Disaggregated serving with different tensor-parallel sizes on each side (local
processes, the embedded model: 9 heads, 3 KV heads): P at TP=3 hands its KV, head slice by
head slice, to D at TP=1, and the reverse; greedy text equals the single-process engine's
and the KV bytes moved show in /metrics."""

from __future__ import annotations

import re

import pytest

from pdserve.scheduler.sampling_params import SamplingParams
from tests.cluster.serving import LOCAL, MODEL, served

pytestmark = pytest.mark.slow

ARGS = (
    *LOCAL, "--num-prefill", "1", "--num-decode", "1", "--dtype", "float32",
    "--kv-cache-memory", "64MiB", "--max-model-len", "512",
)  # fmt: skip
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a dragon"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def greedy() -> list[str]:
    from pdserve import LLM

    llm = LLM(dtype="float32", num_threads=1, kv_cache_memory=64 << 20, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params)]


def _kv_bytes(text: str, role: str) -> float:
    pattern = rf'^pdserve:kv_transfer_bytes_total{{[^}}]*role="{role}"[^}}]*}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))


@pytest.mark.parametrize(
    "sizes",
    [("--prefill-tensor-parallel-size", "3"), ("--decode-tensor-parallel-size", "3")],
    ids=["P3-D1", "P1-D3"],
)
def test_mixed_tp_sizes_serve_the_single_engines_text(greedy, sizes) -> None:
    with served(*ARGS, *sizes, clean=True) as server:
        client = server.openai()
        for prompt, want in zip(PROMPTS, greedy, strict=True):
            result = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
            )
            assert result.choices[0].text == want, prompt
        metrics = server.get("/metrics").text
        assert _kv_bytes(metrics, "prefill") > 0
        assert _kv_bytes(metrics, "decode") == _kv_bytes(metrics, "prefill")
