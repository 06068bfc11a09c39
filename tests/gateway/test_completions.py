"""/v1/completions through the official openai client against a real server."""

from __future__ import annotations

import pytest

from pdserve.common.sampling_params import SamplingParams
from tests.concurrent_streams import streams_and_alone

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("idle_after_module")]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4,",
]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def greedy_reference(offline_llm) -> dict[str, str]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return {
        p: out.text for p, out in zip(PROMPTS, offline_llm.generate(PROMPTS, params), strict=True)
    }


def test_greedy_completions_equal_the_offline_engine(server, greedy_reference) -> None:
    client = server.openai()
    for prompt in PROMPTS:
        result = client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert result.choices[0].text == greedy_reference[prompt], prompt
        assert result.usage.completion_tokens <= MAX_TOKENS
        assert result.choices[0].finish_reason in ("length", "stop")
    # A batch of prompts in one request: one choice per prompt, in order.
    batch = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPTS[:2], max_tokens=MAX_TOKENS, temperature=0
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [greedy_reference[p] for p in PROMPTS[:2]]


def test_streamed_text_adds_up_to_the_whole_and_reports_usage(server, greedy_reference) -> None:
    client = server.openai()
    prompt = PROMPTS[0]
    stream = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == greedy_reference[prompt]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    usage = chunks[-1].usage
    assert usage.prompt_tokens == len(server.post(
        "/tokenize", json={"prompt": prompt}).json()["tokens"])  # fmt: skip
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("length", "stop") and all(f is None for f in finishes[:-1])


def test_stop_string_cuts_the_text_and_finishes_with_stop(server, greedy_reference) -> None:
    client = server.openai()
    prompt = PROMPTS[1]
    full = greedy_reference[prompt]
    stop = full.strip().split()[1]  # a word from the middle of the greedy output
    cut = full[: full.index(stop)]
    result = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
        stop=[stop],
    )  # fmt: skip
    assert result.choices[0].text == cut
    assert result.choices[0].finish_reason == "stop"
    kept = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
        stop=stop, extra_body={"include_stop_str_in_output": True}, stream=True,
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in kept) == cut + stop


def test_seeds_repeat_and_differ(server) -> None:
    client = server.openai()

    def sample(seed: int) -> str:
        return client.completions.create(
            model="SmolLM2-135M-Instruct", prompt="My favourite colour is", max_tokens=10,
            temperature=1.0, seed=seed, extra_body={"ignore_eos": True},
        ).choices[0].text  # fmt: skip

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_n_choices_and_logprobs(server) -> None:
    client = server.openai()
    result = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="The weather today is", max_tokens=4,
        temperature=1.0, n=2, seed=7, logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in result.choices] == [0, 1]
    assert result.choices[0].text != result.choices[1].text  # seeds 7 and 8
    assert result.usage.completion_tokens == 8
    for choice in result.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
        assert "".join(lp.tokens) == choice.text
        for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert value <= 0.0 and token in top and 2 <= len(top) <= 3
    greedy = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="The weather today is", max_tokens=3,
        temperature=0, logprobs=1,
    ).choices[0].logprobs  # fmt: skip
    for value, top in zip(greedy.token_logprobs, greedy.top_logprobs, strict=True):
        assert value == pytest.approx(max(top.values()))  # greedy takes the most likely


def test_vllm_extras_ignore_eos_min_tokens_top_k(server, greedy_reference) -> None:
    client = server.openai()
    prompt = PROMPTS[0]
    top1 = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=MAX_TOKENS, temperature=1.0,
        extra_body={"top_k": 1, "repetition_penalty": 1.0},
    )  # fmt: skip
    assert top1.choices[0].text == greedy_reference[prompt]  # top_k=1 is greedy
    forced = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="Say nothing.", max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True, "min_tokens": 6},
    )  # fmt: skip
    assert forced.usage.completion_tokens == 6 and forced.choices[0].finish_reason == "length"


def test_32_concurrent_streams(server, greedy_reference) -> None:
    texts, alone = streams_and_alone(server, "SmolLM2-135M-Instruct", PROMPTS)
    assert texts == [alone[PROMPTS[i % len(PROMPTS)]] for i in range(32)]


def test_streaming_never_splits_a_multibyte_character(server, offline_llm) -> None:
    prompt = "Emoji list: 😀 😃 😄 😁"  # greedy: an emoji and wide dashes, every token partial
    expected = offline_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8))[0].text
    assert "😊" in expected and "\ufffd" not in expected
    stream = server.openai().completions.create(
        model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=8, temperature=0, stream=True
    )
    pieces = [c.choices[0].text for c in stream]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == expected
    assert len([p for p in pieces if p]) >= 2  # it did arrive in several chunks
