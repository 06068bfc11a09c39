"""What scoring clients (lm-evaluation-harness's `local-completions`) ask of a 1P+1D
deployment, against a colocated one on the same float32 checkpoint: prompt logprobs
(echo, and vLLM's `prompt_logprobs`) are computed on the prefill instance, in chunks
there, and equal the colocated instance's within 1e-4; `logit_bias` holds on both sides
of the handoff."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from experiments.serving import LOCAL, MODEL, ServeProcess, served

pytestmark = pytest.mark.slow

COMMON = (*LOCAL, "--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "512")
# The prefill instance computes prompts in chunks of 16 tokens; the colocated one at once.
SPLIT = (*COMMON, "--num-prefill", "1", "--num-decode", "1", "--max-num-batched-tokens", "16")
COLOCATED = (*COMMON, "--mode", "colocated", "--num-colocated", "1")
TEXTS = [
    "Question: What is the capital of France? Choose Paris, Rome or Berlin.\nAnswer: Paris",
    "The quick brown fox jumps over the lazy dog, and then it runs into the forest again.",
]


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ServeProcess, ServeProcess]]:
    with served(*SPLIT, clean=True) as split, served(*COLOCATED, clean=True) as colocated:
        yield split, colocated


def scored(server: ServeProcess, prompts: list[list[int]]) -> list[list[float | None]]:
    """As lm-eval's loglikelihood requests: token ids, echo, logprobs 1, max_tokens 1."""
    result = server.openai().completions.create(
        model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    return [c.logprobs.token_logprobs for c in sorted(result.choices, key=lambda c: c.index)]


def test_prompt_logprobs_of_a_prefill_instance_equal_a_colocated_ones(servers) -> None:
    split, colocated = servers
    ids = [split.post("/tokenize", json={"prompt": t}).json()["tokens"] for t in TEXTS]
    assert all(len(i) > 16 for i in ids)  # so the prefill instance chunks them
    ours, theirs = scored(split, ids), scored(colocated, ids)
    for mine, reference, prompt in zip(ours, theirs, ids, strict=True):
        assert len(mine) == len(prompt) + 1 and mine[0] is None and reference[0] is None
        assert mine[1:] == pytest.approx(reference[1:], abs=1e-4)
    vllm_shape = split.openai().completions.create(
        model=MODEL, prompt=ids[0], max_tokens=2, temperature=0,
        extra_body={"prompt_logprobs": 0},
    )  # fmt: skip
    entries = vllm_shape.choices[0].model_extra["prompt_logprobs"]
    values = [e[str(t)]["logprob"] for e, t in zip(entries[1:], ids[0][1:], strict=True)]
    assert values == pytest.approx(theirs[0][1 : len(ids[0])], abs=1e-4)


def test_logit_bias_holds_on_the_prefill_and_the_decode_instance(servers) -> None:
    split, _ = servers
    forced = split.post("/tokenize", json={"prompt": " banana"}).json()["tokens"][0]
    result = split.openai().completions.create(
        model=MODEL, prompt=TEXTS[0], max_tokens=4, temperature=0, logit_bias={str(forced): 100}
    )
    # The first token comes from the prefill instance, the rest from the decode one.
    expected = split.post("/detokenize", json={"tokens": [forced] * 4}).json()["prompt"]
    assert result.choices[0].text == expected
