"""/v1/chat/completions through the official openai client against a real server."""

from __future__ import annotations

import pytest

from pdserve.common.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("idle_after_module")]

MODEL = "SmolLM2-135M-Instruct"
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
    ],
]


def test_greedy_chat_equals_the_offline_engine(server, offline_llm) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8)
    client = server.openai()
    for messages in CONVERSATIONS:
        flat = [
            {**m, "content": m["content"][0]["text"]} if isinstance(m["content"], list) else m
            for m in messages
        ]
        expected = offline_llm.chat(flat, params)[0].text
        result = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0
        )
        assert result.choices[0].message.content == expected
        assert result.choices[0].message.role == "assistant"
        assert result.object == "chat.completion"
        prompt_ids = server.post("/tokenize", json={"messages": flat}).json()["tokens"]
        assert result.usage.prompt_tokens == len(prompt_ids)


def test_streamed_chat_role_first_then_content_then_usage(server) -> None:
    client = server.openai()
    messages = CONVERSATIONS[0]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=6, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_max_completion_tokens_seed_and_logprobs(server) -> None:
    client = server.openai()
    args = dict(
        model=MODEL, messages=CONVERSATIONS[0], max_completion_tokens=5, temperature=1.0,
        seed=99, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True},
    )  # fmt: skip
    first = client.chat.completions.create(**args)
    again = client.chat.completions.create(**args)
    assert first.usage.completion_tokens == 5
    assert first.choices[0].finish_reason == "length"
    assert first.choices[0].message.content == again.choices[0].message.content
    content = first.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(item.token for item in content) == first.choices[0].message.content
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.logprob <= 0.0
        best = max(top.logprob for top in item.top_logprobs)
        assert item.logprob <= best + 1e-6
        assert bytes(item.bytes).decode() == item.token


def test_stop_string_and_n_in_chat(server) -> None:
    client = server.openai()
    base = client.chat.completions.create(
        model=MODEL, messages=CONVERSATIONS[0], max_tokens=8, temperature=0
    ).choices[0].message.content  # fmt: skip
    stop = base.split()[1]
    stopped = client.chat.completions.create(
        model=MODEL, messages=CONVERSATIONS[0], max_tokens=8, temperature=0, stop=stop, n=2
    )
    assert [c.index for c in stopped.choices] == [0, 1]
    for choice in stopped.choices:  # greedy: both choices are the same text, cut at stop
        assert choice.message.content == base[: base.index(stop)]
        assert choice.finish_reason == "stop"
