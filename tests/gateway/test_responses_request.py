"""A Responses API body as the chat request that computes it, and the 400s of what it
cannot be. Parsing only; no server (`tests/cluster/test_responses_openai.py` runs one)."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.gateway.errors import APIError
from pdserve.gateway.responses_api import _renamed
from pdserve.gateway.responses_request import ResponsesRequest, chat_request_of


def _chat(**fields):
    return chat_request_of(msgspec.convert(fields, ResponsesRequest))


def test_instructions_and_text_input_become_system_and_user_messages() -> None:
    chat = _chat(
        input="Hi",
        instructions="Be brief.",
        max_output_tokens=7,
        temperature=0.5,
        top_p=0.9,
        stream=True,
        include=[],
        truncation="disabled",
        store=False,
    )
    assert chat.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p, chat.stream) == (
        7,
        0.5,
        0.9,
        True,
    )


def test_items_become_chat_turns() -> None:
    chat = _chat(
        input=[
            {"role": "developer", "content": "Rules."},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "a"},
                    {"type": "input_text", "text": "b"},
                ],
            },
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
            },
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "f",
                "arguments": "{}",
                "id": "fc_1",
            },
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "two"}],
            },
        ]
    )
    roles = [m["role"] for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool"]
    assert chat.messages[1]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "text", "text": "b"},
    ]
    calls = chat.messages[2]["tool_calls"]
    assert [c["id"] for c in calls] == ["c1", "c2"]  # one assistant turn, two calls
    assert calls[0]["function"] == {"name": "f", "arguments": "{}"}
    assert chat.messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "one"}


def test_tools_tool_choice_and_text_format_take_the_chat_apis_shape() -> None:
    tool = {
        "type": "function",
        "name": "f",
        "description": "d",
        "strict": True,
        "parameters": {"type": "object", "properties": {}},
    }
    schema = {"type": "object", "properties": {"x": {"type": "number"}}}
    chat = _chat(
        input="x",
        tools=[tool],
        tool_choice={"type": "function", "name": "f"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "out", "schema": schema}},
    )
    assert chat.tools == [
        {
            "type": "function",
            "function": {"name": "f", "description": "d", "parameters": tool["parameters"]},
        }
    ]
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.parallel_tool_calls is False
    assert chat.response_format.json_schema.schema == schema
    assert _chat(input="x", text={"format": {"type": "json_object"}}).response_format.type == (
        "json_object"
    )
    assert _chat(input="x", text={"format": {"type": "text"}}).response_format is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "r"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"input": []}, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input[0].content[0]"),
        ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
        ({"tools": [{"type": "file_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "name": "f", "defer_loading": True}]}, "tools[0]"),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
    ],
)
def test_what_a_chat_request_cannot_say_is_a_400(fields: dict, param: str) -> None:
    with pytest.raises(APIError) as caught:
        _chat(**{"input": "x", **fields})
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message


def test_an_undeclared_field_is_refused_by_name() -> None:
    from pdserve.gateway.schemas import decode_body

    with pytest.raises(APIError) as caught:
        decode_body(b'{"input": "x", "reasoning": {}}', "application/json", ResponsesRequest)
    assert caught.value.param == "reasoning"


def test_chat_errors_name_the_responses_fields() -> None:
    error = _renamed(APIError(400, "max_completion_tokens is too large", "max_completion_tokens"))
    assert error.param == "max_output_tokens" and error.message.startswith("max_output_tokens")
    error = _renamed(APIError(400, "messages[0]: bad part", "messages[0].content"))
    assert error.param == "input[0].content" and error.message == "input[0]: bad part"
    error = _renamed(APIError(400, "tools[0].function.name must be a string", "tools"))
    assert error.message == "tools[0].name must be a string" and error.param == "tools"
    same = APIError(400, "n must be 1", "n")
    assert _renamed(same) is same
