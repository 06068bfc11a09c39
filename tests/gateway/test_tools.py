"""Tool calls: what a request's tools ask for (forced calls as JSON schemas), the `auto`
parsers on canned model text (the embedded model writes no calls by itself), and how a
streamed choice splits into content and tool-call deltas."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.gateway.errors import APIError
from pdserve.gateway.tool_parsers import HermesParser, Llama3JsonParser, ToolCall
from pdserve.gateway.tools import ToolCallStream, calls_in, plan_tools

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "clock"}},
]


def test_required_is_a_schema_of_calls_to_the_given_tools() -> None:
    plan = plan_tools(TOOLS, "required", None, None)
    schema = json.loads(plan.constraint.json)
    good = [
        {"name": "weather", "parameters": {"city": "Oslo"}},
        {"name": "clock", "parameters": {}},
    ]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "weather", "parameters": {}}], [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(plan_tools(TOOLS, "required", False, None).constraint.json)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)  # parallel_tool_calls: false → one call
    content, calls = calls_in(plan, json.dumps(good))
    assert content is None
    assert calls == [ToolCall("weather", '{"city": "Oslo"}'), ToolCall("clock", "{}")]


def test_a_named_choice_constrains_to_its_parameters() -> None:
    plan = plan_tools(TOOLS, {"type": "function", "function": {"name": "weather"}}, None, None)
    assert json.loads(plan.constraint.json) == PARAMS
    assert calls_in(plan, '{"city": "Rome"}') == (None, [ToolCall("weather", '{"city": "Rome"}')])
    assert calls_in(plan, '{"city": "Ro') == ('{"city": "Ro', [])  # cut by max_tokens


def test_tool_choice_defaults_to_auto_as_openai_does() -> None:
    assert plan_tools(TOOLS, None, None, HermesParser()).mode == "auto"
    assert plan_tools(None, None, None, HermesParser()).mode == "none"
    assert plan_tools(TOOLS, "none", None, None).mode == "none"
    # `tools` alone means auto: without a parser that is a 400 naming the flags, not none.
    for choice in (None, "auto"):
        with pytest.raises(APIError, match="--enable-auto-tool-choice --tool-call-parser") as e:
            plan_tools(TOOLS, choice, None, None)
        assert e.value.status == 400 and e.value.param == "tool_choice"


def test_hermes_reads_smollm2s_list_of_calls_in_one_block() -> None:
    """SmolLM2 (the embedded model) was taught `<tool_call>[{...}, ...]</tool_call>`."""
    text = (
        '<tool_call>[{"name": "weather", "arguments": {"city": "Oslo"}}, '
        '{"name": "clock", "arguments": {}}]</tool_call>'
    )
    assert HermesParser().parse(text) == (
        None, [ToolCall("weather", '{"city": "Oslo"}'), ToolCall("clock", "{}")]
    )  # fmt: skip
    assert HermesParser().parse("<tool_call>[]</tool_call>") == ("<tool_call>[]</tool_call>", [])


def test_hermes_finds_calls_after_content() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call>\n<tool_call>{"name": "clock", "arguments": {}}</tool_call>')  # fmt: skip
    content, calls = HermesParser().parse(text)
    assert content == "Let me check."
    assert calls == [ToolCall("weather", '{"city": "Oslo"}'), ToolCall("clock", "{}")]
    # Unclosed at the end (the model stopped at its end token) still counts.
    assert HermesParser().parse('<tool_call>{"name": "clock", "arguments": {}}')[1]
    # Broken JSON stays content.
    assert HermesParser().parse("<tool_call>{oops</tool_call>") == (
        "<tool_call>{oops</tool_call>",
        [],
    )
    assert HermesParser().parse("just words") == ("just words", [])


def test_llama3_json_reads_one_or_more_objects() -> None:
    parser = Llama3JsonParser()
    text = ('<|python_tag|>{"name": "weather", "parameters": {"city": "Oslo"}}; '
            '{"name": "clock", "parameters": {}}')  # fmt: skip
    assert parser.parse(text) == (
        None,
        [ToolCall("weather", '{"city": "Oslo"}'), ToolCall("clock", "{}")],
    )
    assert parser.parse('{"name": "clock", "arguments": "{}"}') == (None, [ToolCall("clock", "{}")])
    assert parser.parse("The answer is 4.") == ("The answer is 4.", [])
    assert parser.parse('{"city": "Oslo"}') == ('{"city": "Oslo"}', [])  # no name: content


def test_streaming_holds_back_what_may_start_a_call() -> None:
    hermes = HermesParser()
    assert hermes.content_prefix("Sure <tool") == len("Sure ")
    assert hermes.content_prefix("Sure <tool_call>{") == len("Sure ")
    assert hermes.content_prefix("a < b") == len("a < b")
    llama = Llama3JsonParser()
    assert llama.content_prefix(' {"na') == 0 and llama.content_prefix("<|pyth") == 0
    assert llama.content_prefix("Hello") == 5


def test_an_auto_stream_sends_content_then_the_calls() -> None:
    stream = ToolCallStream(plan_tools(TOOLS, "auto", None, HermesParser()))
    pieces = ["Checking", " <tool", '_call>{"name": "clock", ', '"arguments": {}}</tool_call>']
    text, sent, calls = "", "", []
    for i, piece in enumerate(pieces):
        text += piece
        content, deltas = stream.feed(text, piece, finished=i == len(pieces) - 1)
        sent += content
        calls += deltas
    assert sent == "Checking "
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("clock", "{}")]
    assert calls[0]["id"].startswith("call_") and calls[0]["index"] == 0


def test_a_named_stream_sends_arguments_as_they_come() -> None:
    plan = plan_tools(TOOLS, {"type": "function", "function": {"name": "weather"}}, None, None)
    stream = ToolCallStream(plan)
    first = stream.feed('{"city', '{"city', False)
    second = stream.feed('{"city": "Oslo"}', '": "Oslo"}', True)
    assert first[0] == "" and first[1][0]["function"] == {"name": "weather", "arguments": '{"city'}
    assert second[1] == [{"index": 0, "function": {"arguments": '": "Oslo"}'}}]
