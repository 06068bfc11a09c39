"""Structured output and tool calls through the `openai` client against one prefill and one
decode instance (local processes, the embedded model): answers parse and validate, and the
mask acts while sampling (on P's first token and on every step of D), not as a repair.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pydantic
import pytest

from experiments.serving import LOCAL, MODEL, ServeProcess, served

pytestmark = pytest.mark.slow

ARGS = (
    *LOCAL, "--num-prefill", "1", "--num-decode", "1", "--kv-cache-memory", "64MiB",
    "--max-model-len", "1024", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
)  # fmt: skip


def _object(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties,
            "required": required or list(properties), "additionalProperties": False}  # fmt: skip


END_TOKENS = ("<|im_end|>", "<|endoftext|>")  # the embedded model's: allowed once complete
SHORT = {"type": "string", "maxLength": 12}
CASES = [
    ("Name a city and its country as JSON.", _object({"city": SHORT, "country": SHORT})),
    ("Describe a person as JSON.",
     _object({"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("Is the sky blue? Answer in JSON.", _object({"answer": {"type": "boolean"}})),
    ("Pick a color.", _object({"color": {"enum": ["red", "green", "blue"]}})),
    ("List some numbers.",
     {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
      "minItems": 2, "maxItems": 4}),
    ("Give a 2D point.",
     _object({"point": _object({"x": {"type": "integer"}, "y": {"type": "integer"}})})),
    ("Tag this post about cooking.",
     _object({"tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                       "maxItems": 3}})),
    ("Rate this movie from 0 to 10.", _object({"score": {"type": "number", "minimum": 0,
                                                         "maximum": 10}})),
    ("Name a capital city.", {"type": "string", "pattern": "^[A-Z][a-z]{2,8}$"}),
    ("Describe a film as JSON.",
     _object({"title": {"type": "string", "maxLength": 16},
              "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
              "rating": {"enum": [1, 2, 3, 4, 5]}})),
]  # fmt: skip
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": _object({"city": SHORT, "unit": {"enum": ["celsius", "fahrenheit"]}}),
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": _object({"zone": SHORT})},
}


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    with served(*ARGS, clean=True) as process:
        yield process


def _chat(client, prompt: str, **kwargs):
    messages = [{"role": "user", "content": prompt}]
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def test_json_schema_answers_validate_streamed_and_not(server) -> None:
    client = server.openai()

    def ask(case: tuple[int, tuple[str, dict], bool]) -> tuple[str, list[str], str]:
        seed, (prompt, schema), stream = case
        kwargs = dict(response_format=_json_schema(schema), max_tokens=80, temperature=0.8,
                      seed=seed)  # fmt: skip
        if not stream:
            result = _chat(client, prompt, **kwargs)
            return result.choices[0].message.content, [], result.choices[0].finish_reason
        parts, finish = [], None
        for chunk in _chat(client, prompt, stream=True, **kwargs):
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        return "".join(parts), parts, finish

    cases = [(i, case, stream) for stream in (False, True) for i, case in enumerate(CASES)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, cases))
    for (_, (prompt, schema), stream), (text, parts, finish) in zip(cases, answers, strict=True):
        assert finish == "stop", (prompt, stream, text)
        jsonschema.validate(json.loads(text), schema)
        if stream:  # every prefix the client saw could still become valid JSON
            seen = ""
            for part in parts:
                seen += part
                assert is_json_prefix(seen), (prompt, seen)


class City(pydantic.BaseModel):
    name: str
    population_millions: float


def test_parse_returns_an_object_whose_float_ended(server) -> None:
    """The SDK's `parse()` with a float field, greedy: the number ends and the object
    parses (unbounded digits ran to max_tokens: `finish_reason: length`)."""
    result = server.openai().chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about Tokyo."}],
        response_format=City, temperature=0, max_tokens=100,
    )  # fmt: skip
    choice = result.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert choice.message.parsed.name == "Tokyo"


def test_whitespace_is_free_unless_the_request_turns_it_off(server) -> None:
    """vLLM's default lets the model write whitespace between JSON tokens (this model
    does); `disable_any_whitespace` forbids it: not even among the alternatives."""
    schema = City.model_json_schema()
    texts = {}
    for compact in (False, True):
        result = _chat(
            server.openai(), "Tell me about Tokyo.", temperature=0, max_tokens=100,
            logprobs=True, top_logprobs=10, extra_body={"structured_outputs": {
                "json": schema, "disable_any_whitespace": compact}},
        )  # fmt: skip
        choice = result.choices[0]
        assert choice.finish_reason == "stop"
        City.model_validate_json(choice.message.content)
        texts[compact] = choice.message.content
        alternatives = [a.token for e in choice.logprobs.content for a in e.top_logprobs]
        assert any("\n" in t for t in alternatives) != compact
    assert "\n" in texts[False] and "\n" not in texts[True], texts


def test_guided_choice_is_always_one_of_the_choices(server) -> None:
    client = server.openai()
    choices = ["apple", "banana", "cherry"]
    for seed in range(6):
        result = client.completions.create(
            model=MODEL, prompt="My favourite fruit is", max_tokens=8, temperature=1.5,
            seed=seed, extra_body={"guided_choice": choices},
        )  # fmt: skip
        assert result.choices[0].text in choices


def test_regex_constrains_the_prefill_instances_first_token(server) -> None:
    """In 1P+1D the first token is sampled on P: it obeys the pattern, and its
    alternatives (top logprobs) are only tokens the pattern allows there."""
    before = _first_tokens_from_prefill(server)
    result = server.openai().completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0,
        logprobs=5, extra_body={"structured_outputs": {"regex": "Zq[0-9]{3}"}},
    )  # fmt: skip
    assert _first_tokens_from_prefill(server) == before + 1  # P sampled it
    choice = result.choices[0]
    assert re.fullmatch("Zq[0-9]{3}", choice.text), choice.text
    first = choice.logprobs.top_logprobs[0]
    assert first and all("Zq".startswith(t) or t.startswith("Zq") for t in first), first
    for alternatives in choice.logprobs.top_logprobs:
        assert all(math.isfinite(v) for v in alternatives.values())


def _first_tokens_from_prefill(server: ServeProcess) -> float:
    text = server.get("/metrics").text
    pattern = r'^pdserve:time_to_first_token_seconds_count{[^}]*role="prefill"[^}]*} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))


def test_masked_tokens_have_no_finite_logprobs(server) -> None:
    result = _chat(
        server.openai(), "Yes or no?", max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=10, extra_body={"guided_choice": ["yes", "no"]},
    )  # fmt: skip
    choice = result.choices[0]
    assert choice.message.content in ("yes", "no")
    text = ""
    for entry in choice.logprobs.content:
        for alternative in entry.top_logprobs:
            assert math.isfinite(alternative.logprob)
            candidate = text + alternative.token
            done = text in ("yes", "no") and alternative.token in END_TOKENS
            assert done or any(c.startswith(candidate) for c in ("yes", "no")), candidate
        text += entry.token


def test_required_tool_choice_gives_calls_that_validate(server) -> None:
    for stream in (False, True):
        kwargs = dict(tools=[WEATHER, TIME], tool_choice="required", max_tokens=100,
                      temperature=0)  # fmt: skip
        if stream:
            calls, finish = _streamed_calls(_chat(server.openai(), "Weather in Paris?",
                                                  stream=True, **kwargs))  # fmt: skip
        else:
            choice = _chat(server.openai(), "Weather in Paris?", **kwargs).choices[0]
            calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
            finish = choice.finish_reason
        assert finish == "tool_calls" and calls
        tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), tools[name])


def test_named_tool_choice_streams_its_arguments(server) -> None:
    chunks = list(
        _chat(server.openai(), "Weather in Oslo?", tools=[WEATHER, TIME], max_tokens=60,
              tool_choice={"type": "function", "function": {"name": "get_weather"}},
              temperature=0, stream=True)
    )  # fmt: skip
    calls, finish = _streamed_calls(chunks)
    assert finish == "tool_calls"
    assert [name for name, _ in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0][1]), WEATHER["function"]["parameters"])
    argument_chunks = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(argument_chunks) > 1  # the arguments came as they were sampled


def test_auto_tool_choice_parses_the_models_text(server) -> None:
    """The embedded model writes no tool calls by itself: a regex makes it write a Hermes
    call, which the auto parser must turn into `tool_calls`."""
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    result = _chat(
        server.openai(), "What time is it?", tools=[WEATHER, TIME], tool_choice="auto",
        max_tokens=60, temperature=0, extra_body={"guided_regex": re.escape(call)},
    )  # fmt: skip
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == [("get_time", {"zone": "UTC"})]  # fmt: skip


def _streamed_calls(chunks) -> tuple[list[tuple[str, str]], str | None]:
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, ["", ""])
                if delta.function.name:
                    entry[0] = delta.function.name
                entry[1] += delta.function.arguments or ""
    return [(name, arguments) for name, arguments in calls.values()], finish


def is_json_prefix(text: str) -> bool:
    """Whether some continuation of `text` is one JSON value (a small recursive parser
    that accepts running out of input anywhere a value could go on)."""
    try:
        end = _value(text, _skip(text, 0))
    except _Incomplete:
        return True
    except ValueError:
        return False
    return _skip(text, end) == len(text)


class _Incomplete(Exception):
    pass


def _skip(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


def _need(s: str, i: int) -> None:
    if i >= len(s):
        raise _Incomplete


def _value(s: str, i: int) -> int:
    _need(s, i)
    c = s[i]
    if c == "{":
        return _container(s, i, "}", member=True)
    if c == "[":
        return _container(s, i, "]", member=False)
    if c == '"':
        return _string(s, i)
    for word in ("true", "false", "null"):
        if word.startswith(s[i : i + len(word)]) and s[i] == word[0]:
            if len(s) - i < len(word):
                raise _Incomplete
            return i + len(word)
    match = re.match(r"-?(0|[1-9][0-9]*)?(\.[0-9]*)?([eE][-+]?[0-9]*)?", s[i:])
    if match and match.group(0):
        if i + match.end() == len(s):
            raise _Incomplete
        if not re.fullmatch(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?", match.group(0)):
            raise ValueError(s[i:])
        return i + match.end()
    raise ValueError(s[i:])


def _string(s: str, i: int) -> int:
    i += 1
    while True:
        _need(s, i)
        if s[i] == "\\":
            i += 2
        elif s[i] == '"':
            return i + 1
        else:
            i += 1


def _container(s: str, i: int, close: str, member: bool) -> int:
    i = _skip(s, i + 1)
    _need(s, i)
    if s[i] == close:
        return i + 1
    while True:
        if member:
            _need(s, i)
            if s[i] != '"':
                raise ValueError(s[i:])
            i = _skip(s, _string(s, i))
            _need(s, i)
            if s[i] != ":":
                raise ValueError(s[i:])
            i = _skip(s, i + 1)
        i = _skip(s, _value(s, i))
        _need(s, i)
        if s[i] == close:
            return i + 1
        if s[i] != ",":
            raise ValueError(s[i:])
        i = _skip(s, i + 1)
