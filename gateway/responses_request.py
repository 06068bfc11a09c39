"""The body of `POST /v1/responses` (OpenAI's Responses API), and the chat request it
becomes.

A response is a chat completion in another shape: `instructions` become a system
message, `input` (a string, or a list of messages, function calls and their outputs)
the messages that follow, `max_output_tokens` the completion's limit, flat function
tools the chat API's nested ones, and `text.format` a `response_format`. What the
Responses API has and pdserve does not do (stored responses, hosted tools, reasoning,
images) is a 400 naming the field, like any field not declared here.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pdserve.gateway.errors import bad_request
from pdserve.gateway.schemas import ChatCompletionRequest
from pdserve.gateway.structured import JSONSchemaFormat, ResponseFormat

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text")
# Where a chat-side error names a field, the Responses API's name for it.
RENAMED_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}
NOT_STORED = (
    "pdserve stores no responses (every response is store: false): send the whole "
    "conversation in `input`"
)


class TextFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str  # text | json_object | json_schema
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: TextFormat | None = None
    verbosity: str | None = None  # only unset: nothing here can make a model terser


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    store: bool | None = None  # false or unset: nothing is kept
    previous_response_id: str | None = None  # refused: nothing is kept to continue
    include: list[str] | None = None  # empty only (the Agents SDK sends [])
    truncation: str | None = None  # "disabled" only: a prompt too long is a 400
    # Accepted and ignored, as on the chat API: they describe the caller.
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


def check_unsupported(body: ResponsesRequest) -> None:
    if body.previous_response_id is not None:
        raise bad_request(
            f"previous_response_id is not supported: {NOT_STORED}", "previous_response_id"
        )
    if body.store:
        raise bad_request(f"store: true is not supported: {NOT_STORED}", "store")
    if body.include:
        raise bad_request(f"include is not supported (got {body.include[0]!r})", "include")
    if body.truncation not in (None, "disabled"):
        raise bad_request('truncation must be "disabled"', "truncation")
    if body.text is not None and body.text.verbosity is not None:
        raise bad_request("text.verbosity is not supported", "text.verbosity")


def chat_request_of(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion that computes this response."""
    check_unsupported(body)
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        messages.extend(_messages(body.input))
    if not messages:
        raise bad_request("input must not be empty", param="input")
    return ChatCompletionRequest(
        messages=messages,
        model=body.model,
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        stream=body.stream,
        tools=_chat_tools(body.tools) if body.tools else None,
        tool_choice=_chat_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=_response_format(body.text),
        user=body.user,
        metadata=body.metadata,
        service_tier=body.service_tier,
    )


def _messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, i))
        elif kind == "function_call":
            call = {
                "id": _text(item, "call_id", i),
                "type": "function",
                "function": {
                    "name": _text(item, "name", i),
                    "arguments": _text(item, "arguments", i),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # one turn, several calls
            else:
                # "" rather than null: templates that know no tool calls still render
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _parts(output, f"input[{i}].output")
            messages.append(
                {"role": "tool", "tool_call_id": _text(item, "call_id", i), "content": content}
            )
        else:
            raise bad_request(
                f"input[{i}] is of type {kind!r}: pdserve takes message, function_call and "
                "function_call_output items",
                param=f"input[{i}].type",
            )
    return messages


def _message(item: dict[str, Any], i: int) -> dict[str, Any]:
    given = item.get("role")
    role = ROLES.get(given) if isinstance(given, str) else None
    if role is None:
        raise bad_request(
            f"input[{i}].role must be one of {', '.join(ROLES)}", param=f"input[{i}].role"
        )
    content = item.get("content")
    if not isinstance(content, str):
        content = _parts(content, f"input[{i}].content")
    return {"role": role, "content": content}


def _parts(content: Any, where: str) -> list[dict[str, str]]:
    """Text parts as the chat API's; any other part (images, files) is a 400."""
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of parts", param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(
                f"{where}[{j}] is of type {kind!r}: pdserve takes text parts only "
                f"({', '.join(TEXT_PARTS)}, with a string `text`)",
                param=f"{where}[{j}]",
            )
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _text(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"input[{i}].{key} must be a string", param=f"input[{i}].{key}")
    return value


FUNCTION_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    converted = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(
                f"tools[{i}] is of type {tool.get('type')!r}: pdserve runs function tools only",
                param=f"tools[{i}].type",
            )
        extra = sorted(set(tool) - FUNCTION_TOOL_KEYS)
        if extra:
            raise bad_request(f"tools[{i}]: unsupported field `{extra[0]}`", f"tools[{i}]")
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        converted.append({"type": "function", "function": function})
    return converted


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice  # none, auto, required (or a bad word the chat path refuses)
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise bad_request(
            'tool_choice must be none, auto, required or {"type": "function", "name": ...}',
            param="tool_choice",
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: TextConfig | None) -> ResponseFormat | None:
    form = text.format if text is not None else None
    if form is None or form.type == "text":
        return None
    if form.type == "json_object":
        return ResponseFormat(type="json_object")
    if form.type != "json_schema":
        raise bad_request(
            f"text.format.type must be text, json_object or json_schema, got {form.type!r}",
            param="text.format",
        )
    if form.schema is None:
        raise bad_request("text.format json_schema needs `schema`", param="text.format")
    schema = JSONSchemaFormat(
        name=form.name or "response",
        schema=form.schema,
        description=form.description,
        strict=form.strict,
    )
    return ResponseFormat(type="json_schema", json_schema=schema)
