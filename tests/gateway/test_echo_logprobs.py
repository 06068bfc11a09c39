"""Completions `echo`, `prompt_logprobs`, `logit_bias` and `continuous_usage_stats` through
the official openai client against the shared colocated server, shaped as OpenAI and vLLM
answer them (what lm-evaluation-harness's `local-completions` reads for loglikelihood)."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from experiments.serving import MODEL, ServeProcess

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("idle_after_module")]

TEXT = "The capital of France is Paris"
USAGE_ON_EVERY_CHUNK = {"include_usage": True, "continuous_usage_stats": True}


@pytest.fixture(scope="module")
def ids(server) -> list[int]:
    return server.post("/tokenize", json={"prompt": TEXT}).json()["tokens"]


def test_echo_scores_a_token_id_prompt_as_lm_eval_asks(server, ids) -> None:
    """`echo: true, logprobs: 1, max_tokens: 1` with token ids: one entry per prompt token
    (the first null), then the generated token's."""
    result = server.openai().completions.create(
        model=MODEL, prompt=[ids], echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    choice = result.choices[0]
    lp = choice.logprobs
    n = len(ids)
    assert choice.text.startswith(TEXT) and len(choice.text) > len(TEXT)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n + 1)]
    for token, value, top in zip(
        lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True
    ):
        assert value <= 0 and top[token] == value and 1 <= len(top) <= 2
    assert result.usage.prompt_tokens == n and result.usage.completion_tokens == 1
    # The same prompt as text scores the same.
    as_text = server.openai().completions.create(
        model=MODEL, prompt=TEXT, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    assert as_text.choices[0].logprobs.token_logprobs == lp.token_logprobs


def test_echo_without_generation_and_without_logprobs(server, ids) -> None:
    client = server.openai()
    alone = client.completions.create(
        model=MODEL, prompt=[ids], echo=True, logprobs=0, max_tokens=0, temperature=0
    )
    assert alone.choices[0].text == TEXT
    assert len(alone.choices[0].logprobs.token_logprobs) == len(ids)
    assert alone.usage.completion_tokens == 1  # generated and not shown: counted, as in vLLM
    plain = client.completions.create(model=MODEL, prompt=TEXT, echo=True, max_tokens=3,
                                      temperature=0)  # fmt: skip
    assert plain.choices[0].text.startswith(TEXT) and plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt=TEXT, max_tokens=0)


def streamed(server: ServeProcess, **request: Any) -> list[Any]:
    """Every chunk of a streamed completion of TEXT."""
    client = server.openai()
    return list(client.completions.create(model=MODEL, prompt=TEXT, stream=True, **request))


def test_echo_streams_with_n(server, ids) -> None:
    chunks = streamed(server, echo=True, logprobs=1, max_tokens=3, n=2, seed=5, temperature=0.8)
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        text = "".join(c.text for c in mine)
        entries = [v for c in mine if c.logprobs for v in c.logprobs.token_logprobs]
        offsets = [v for c in mine if c.logprobs for v in c.logprobs.text_offset]
        assert text.startswith(TEXT) and mine[0].text.startswith(TEXT)
        assert entries[0] is None and len(entries) == len(ids) + 3
        assert offsets == sorted(offsets) and offsets[0] == 0


def test_prompt_logprobs_on_completions_and_chat(server, ids) -> None:
    client = server.openai()
    result = client.completions.create(
        model=MODEL, prompt=[ids], max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    echoed = client.completions.create(
        model=MODEL, prompt=[ids], echo=True, logprobs=2, max_tokens=1, temperature=0
    )
    scored = result.choices[0].model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    for token_id, entry, value in zip(
        ids[1:],
        scored[1:],
        echoed.choices[0].logprobs.token_logprobs[1 : len(ids)],
        strict=True,
    ):
        mine = entry[str(token_id)]
        assert mine["logprob"] == value and mine["rank"] >= 1 and "decoded_token" in mine
        assert 2 <= len(entry) <= 3  # the two most likely, and the prompt's own
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )  # fmt: skip
    prompt_logprobs = chat.model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and all(len(e) == 1 for e in prompt_logprobs[1:])
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model=MODEL, prompt=TEXT, stream=True,
                                  extra_body={"prompt_logprobs": 1})  # fmt: skip


def test_logit_bias_steers_greedy_output_and_is_checked(server, ids) -> None:
    client = server.openai()
    forced = ids[-1]
    result = client.completions.create(
        model=MODEL, prompt=TEXT, max_tokens=3, temperature=0, logit_bias={str(forced): 100}
    )
    assert result.choices[0].text == server.post(
        "/detokenize", json={"tokens": [forced] * 3}).json()["prompt"]  # fmt: skip
    plain = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=1, temperature=0,
                                      logprobs=0)  # fmt: skip
    first = server.post("/tokenize", json={"prompt": plain.choices[0].text}).json()["tokens"][0]
    banned = client.completions.create(
        model=MODEL, prompt=TEXT, max_tokens=1, temperature=0, logit_bias={str(first): -100}
    )
    assert banned.choices[0].text != plain.choices[0].text
    for bias in ({"99999999": 1}, {"x": 1}, {str(first): 101}):
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=MODEL, prompt=TEXT, max_tokens=1, logit_bias=bias)
        assert error.value.body["param"] == "logit_bias"


def test_continuous_usage_stats_put_usage_on_every_chunk(server) -> None:
    chunks = streamed(server, max_tokens=4, temperature=0, stream_options=USAGE_ON_EVERY_CHUNK)
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 4 and counts[0] >= 1
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
               for c in chunks)  # fmt: skip
    chat = list(
        server.openai().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            stream=True,
            stream_options=USAGE_ON_EVERY_CHUNK,
        )  # fmt: skip
    )
    assert all(c.usage is not None for c in chat) and chat[0].usage.completion_tokens == 0
