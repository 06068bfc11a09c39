"""Tool calling on the chat endpoint: what `tools` and `tool_choice` ask, and the calls
that come back.

`none`: the tools only reach the chat template. `auto`, OpenAI's default with `tools` (with
`--enable-auto-tool-choice --tool-call-parser NAME`, else a 400 naming them): the model
writes freely and the parser finds its calls.
`required` and a named function are forced through structured output, so the arguments
always validate against the tool's parameters: a named call's output is its arguments
object; `required` outputs `[{"name": ..., "parameters": {...}}, ...]` with each item
bound to one tool's schema. Calls come back as `tool_calls` with `finish_reason:
"tool_calls"`, streamed as deltas (a named call's arguments as they are sampled; other
calls once their text is complete).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from pdserve.common.structured_output import StructuredOutput
from pdserve.gateway.errors import bad_request
from pdserve.gateway.structured import check_json_schema
from pdserve.gateway.tool_parsers import ToolCall, ToolParser

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # none | auto | required | named
    functions: list[Function]
    constraint: StructuredOutput | None = None
    parser: ToolParser | None = None
    forced: str | None = None  # the named function

    @property
    def returns_calls(self) -> bool:
        return self.mode != "none"


def _functions(tools: list[dict[str, Any]]) -> list[Function]:
    functions = []
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise bad_request(
                f'{param} must be {{"type": "function", "function": {{...}}}}', "tools"
            )
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{param}.function.name must be a non-empty string", "tools")
        parameters = function.get("parameters", EMPTY_PARAMETERS)
        check_json_schema(parameters, f"{param}.function.parameters", "tools")
        functions.append(Function(name, parameters))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("tools have two functions of one name", "tools")
    return functions


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    auto_parser: ToolParser | None,
) -> ToolPlan:
    """What the request's tools mean; a choice this server cannot honour is a 400."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs `tools`", param="tool_choice")
        return ToolPlan("none", [])
    functions = _functions(tools)
    if tool_choice is None:  # OpenAI's default with tools
        tool_choice = "auto"
    if tool_choice == "none":
        return ToolPlan("none", functions)
    if tool_choice == "auto":
        if auto_parser is None:
            raise bad_request(
                'tool_choice "auto" (the default with `tools`) needs the server started with '
                '`--enable-auto-tool-choice --tool-call-parser NAME`; or send tool_choice "none"',
                param="tool_choice",
            )
        return ToolPlan("auto", functions, parser=auto_parser)
    if tool_choice == "required":
        return ToolPlan("required", functions, _required_constraint(functions, parallel_tool_calls))
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request(
                'tool_choice must be none, auto, required or {"type": "function", '
                '"function": {"name": ...}}',
                param="tool_choice",
            )
        chosen = next((f for f in functions if f.name == name), None)
        if chosen is None:
            raise bad_request(
                f"tool_choice names {name!r}, which is not among `tools`", "tool_choice"
            )
        constraint = StructuredOutput(json=json.dumps(chosen.parameters))
        return ToolPlan("named", functions, constraint, forced=name)
    raise bad_request(f"unknown tool_choice {tool_choice!r}", param="tool_choice")


def _required_constraint(functions: list[Function], parallel: bool | None) -> StructuredOutput:
    item = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": f.name}, "parameters": f.parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for f in functions
        ]
    }
    schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if parallel is False:
        schema["maxItems"] = 1
    return StructuredOutput(json=json.dumps(schema))


def calls_in(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """A finished output as (content, calls); output that does not parse stays content
    (a forced call cut short by max_tokens)."""
    if plan.mode == "named" and plan.forced is not None:
        try:
            json.loads(text)
        except ValueError:
            return text, []
        return None, [ToolCall(plan.forced, text)]
    if plan.mode == "required":
        try:
            items = json.loads(text)
            calls = [
                ToolCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items
            ]
        except (ValueError, TypeError, KeyError):
            return text, []
        return None, calls
    if plan.mode == "auto" and plan.parser is not None:
        return plan.parser.parse(text)
    return text, []


def call_entry(index: int, call: ToolCall, call_id: str) -> dict[str, Any]:
    return {
        "index": index,
        "id": call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason_with(calls: list[ToolCall], finish_reason: str | None) -> str | None:
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


@dataclass
class ToolCallStream:
    """One streamed choice under a tool plan: which text goes out as content, which as
    tool-call deltas."""

    plan: ToolPlan
    sent_content: int = 0  # characters of the text already sent as content
    named_id: str | None = None
    ids: list[str] = field(default_factory=list)

    def feed(self, text: str, new_text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """`text`: the choice's whole text so far, `new_text` its latest part; returns the
        content to send now and the tool-call deltas."""
        if self.plan.mode == "named":
            return "", self._named(new_text)
        if not finished:
            if self.plan.mode == "auto" and self.plan.parser is not None:
                return self._content_up_to(text, self.plan.parser.content_prefix(text)), []
            return "", []
        _, calls = calls_in(self.plan, text)
        if not calls:
            return self._content_up_to(text, len(text)), []
        content_end = self.plan.parser.content_prefix(text) if self.plan.parser else 0
        head = self._content_up_to(text, content_end)
        entries = []
        for index, call in enumerate(calls):
            self.ids.append(new_call_id())
            entries.append(call_entry(index, call, self.ids[-1]))
        return head, entries

    def _content_up_to(self, text: str, end: int) -> str:
        if end <= self.sent_content:
            return ""
        out, self.sent_content = text[self.sent_content : end], end
        return out

    def _named(self, new_text: str) -> list[dict[str, Any]]:
        if self.named_id is None:
            if not new_text:
                return []
            self.named_id = new_call_id()
            self.ids.append(self.named_id)
            return [call_entry(0, ToolCall(self.plan.forced or "", new_text), self.named_id)]
        return [{"index": 0, "function": {"arguments": new_text}}] if new_text else []
