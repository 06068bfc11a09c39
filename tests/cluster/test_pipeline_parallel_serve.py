"""Disaggregated serving of a tiny random Qwen3 (2 layers, 4 KV heads; local processes)
with different groups on each side: P at TP=2 × PP=2 hands each stage's layers, head
slice by head slice, to the same stage of D at TP=1 × PP=2; P at TP=1 hands its heads to
D at TP=2. Greedy text and logprobs equal the single-process engine's, both sides count
the same KV bytes, and each rank the bytes of its slice."""

from __future__ import annotations

import re

import pytest

from experiments.serving import LOCAL, served
from pdserve.common.sampling_params import SamplingParams
from tests.engine.test_tensor_parallel import qwen3

pytestmark = pytest.mark.slow
__all__ = ["qwen3"]  # the tiny random Qwen3 fixture, shared with the engine's TP tests

PROMPTS = [[5, 17, 300, 42, 7], list(range(100, 140))]  # ids: the model's vocabulary is 1001
MAX_TOKENS = 8


def _metric(text: str, name: str, role: str) -> float:
    pattern = rf'^pdserve:{name}{{[^}}]*role="{role}"[^}}]*}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))


def _rank_bytes(text: str, role: str) -> list[float]:
    pattern = rf'^pdserve:kv_transfer_rank_bytes_total{{[^}}]*role="{role}"[^}}]*}} (\S+)$'
    return sorted(float(v) for v in re.findall(pattern, text, re.MULTILINE))


@pytest.fixture(scope="module")
def offline(qwen3) -> list:
    from pdserve import LLM

    llm = LLM(model=qwen3, dtype="float32", num_threads=1, kv_cache_memory=16 << 20,
              max_model_len=256)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True)
    return [o.outputs[0] for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize(
    ("sizes", "prefill_ranks", "decode_ranks"),
    [
        (("-pp", "2", "--prefill-tensor-parallel-size", "2"), 4, 2),
        (
            (
                "--decode-tensor-parallel-size",
                "2",
            ),
            1,
            2,
        ),
    ],
    ids=["P-tp2pp2-D-tp1pp2", "P-tp1-D-tp2"],
)
def test_groups_of_different_shapes_serve_the_single_engines_text_and_logprobs(
    qwen3, offline, sizes, prefill_ranks, decode_ranks
) -> None:
    args = (
        *LOCAL, "--model", qwen3, "--num-prefill", "1", "--num-decode", "1",
        "--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "256", *sizes,
        "--block-size", "16",
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
        moved = 4 * 2 * 2 * 4 * 16 * 16 * 4
        assert _metric(metrics, "kv_transfer_bytes_total", "decode") == moved
        assert _metric(metrics, "kv_transfer_bytes_total", "prefill") == moved
        # Each rank moved its slice: its stage's layers and its heads.
        assert _rank_bytes(metrics, "prefill") == [moved / prefill_ranks] * prefill_ranks
        assert _rank_bytes(metrics, "decode") == [moved / decode_ranks] * decode_ranks
        assert _metric(metrics, "kv_transfer_failures_total", "decode") == 0
        assert _metric(metrics, "kv_transfer_recomputed_requests_total", "decode") == 0
