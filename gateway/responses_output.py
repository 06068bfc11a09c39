"""A response object of OpenAI's Responses API, whole or as its stream of events.

One generated choice becomes `output` items: an assistant `message` with one
`output_text` part, and one `function_call` item per call the tool plan finds in the
text (`gateway/tools.py`, as the chat API finds them). Streamed, each item opens
(`response.output_item.added`), grows by deltas and closes (`…done`), every event
numbered by `sequence_number`; the last event carries the whole response.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pdserve.gateway.generation import Choice, ChoiceUpdate
from pdserve.gateway.responses_request import ResponsesRequest
from pdserve.gateway.tools import ToolCallStream, ToolPlan, calls_in, new_call_id


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass
class _Call:
    """A function call item being streamed."""

    item: dict[str, Any]
    output_index: int


@dataclass
class ResponseWriter:
    response_id: str
    model: str
    body: ResponsesRequest
    tools: ToolPlan
    temperature: float
    top_p: float
    created_at: int = field(default_factory=lambda: int(time.time()))
    output: list[dict[str, Any]] = field(default_factory=list)
    _sequence: int = 0
    _message: dict[str, Any] | None = None  # the message item while its text streams
    _message_index: int = 0
    _calls: dict[int, _Call] = field(default_factory=dict)  # by the chat API's call index
    _stream: ToolCallStream | None = None

    # ---- the response object ----------------------------------------------------------

    def response(
        self, status: str, usage: dict[str, int] | None = None, finish_reason: str | None = None
    ) -> dict[str, Any]:
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        text_format = body.text.format if body.text and body.text.format else None
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": self.output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "text": {"format": _format_of(text_format)},
            "tool_choice": body.tool_choice if body.tool_choice is not None else self.tools.mode,
            "tools": body.tools or [],
            "truncation": "disabled",
            "user": body.user,
            "metadata": body.metadata or {},
            "usage": _usage(usage) if usage else None,
        }

    def finished(self, choice: Choice, usage: dict[str, int]) -> dict[str, Any]:
        """The whole response of a finished choice (not streamed)."""
        content, calls = calls_in(self.tools, choice.stream.text)
        if content or not calls:
            self.output.append(self._message_item(content or "", "completed"))
        for call in calls:
            self.output.append(self._call_item(new_call_id(), call.name, call.arguments))
        return self.response(_status(choice), usage, choice.finish_reason)

    def _message_item(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [_text_part(text)]
        return {
            "type": "message",
            "id": _item_id("msg"),
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def _call_item(
        self, call_id: str, name: str, arguments: str, status: str = "completed"
    ) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": _item_id("fc"),
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": status,
        }

    # ---- the stream -------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}

    def opening(self) -> list[dict[str, Any]]:
        return [
            self.event("response.created", response=self.response("in_progress")),
            self.event("response.in_progress", response=self.response("in_progress")),
        ]

    def feed(self, update: ChoiceUpdate) -> list[dict[str, Any]]:
        """The events of one update of the choice (its end excluded: `closing`)."""
        if not self.tools.returns_calls:
            return self._text(update.text)
        if self._stream is None:
            self._stream = ToolCallStream(self.tools)
        finished = update.finish_reason is not None
        content, calls = self._stream.feed(update.choice.stream.text, update.text, finished)
        events = self._text(content)
        for delta in calls:
            events += self._call_delta(delta)
        return events

    def closing(self, choice: Choice, usage: dict[str, int]) -> list[dict[str, Any]]:
        events = []
        if self._message is None and not self._calls:
            events += self._text("", force=True)  # a response always says something
        events += self._close_message()
        for call in self._calls.values():
            item = call.item
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=call.output_index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
            item["status"] = "completed"
            events.append(
                self.event("response.output_item.done", output_index=call.output_index, item=item)
            )
        status = _status(choice)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [
            *events,
            self.event(kind, response=self.response(status, usage, choice.finish_reason)),
        ]

    def _text(self, text: str, force: bool = False) -> list[dict[str, Any]]:
        if not text and not force:
            return []
        events = []
        if self._message is None:
            self._message = self._message_item(None, "in_progress")
            self._message_index = len(self.output)
            self.output.append(self._message)
            events.append(
                self.event(
                    "response.output_item.added",
                    output_index=self._message_index,
                    item=dict(self._message),
                )
            )
            self._message["content"] = [_text_part("")]
            events.append(self._part_event("response.content_part.added"))
        self._message["content"][0]["text"] += text
        if text:
            events.append(
                self.event(
                    "response.output_text.delta",
                    item_id=self._message["id"],
                    output_index=self._message_index,
                    content_index=0,
                    delta=text,
                    logprobs=[],
                )
            )
        return events

    def _part_event(self, kind: str) -> dict[str, Any]:
        assert self._message is not None
        return self.event(
            kind,
            item_id=self._message["id"],
            output_index=self._message_index,
            content_index=0,
            part=dict(self._message["content"][0]),
        )

    def _close_message(self) -> list[dict[str, Any]]:
        message = self._message
        if message is None or message["status"] == "completed":
            return []
        message["status"] = "completed"
        text = message["content"][0]["text"]
        return [
            self.event(
                "response.output_text.done",
                item_id=message["id"],
                output_index=self._message_index,
                content_index=0,
                text=text,
                logprobs=[],
            ),
            self._part_event("response.content_part.done"),
            self.event("response.output_item.done", output_index=self._message_index, item=message),
        ]

    def _call_delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """A chat-API tool-call delta as Responses events: a new call opens its item."""
        events = self._close_message()  # the text before a call is complete
        arguments = delta["function"].get("arguments") or ""
        call = self._calls.get(delta["index"])
        if call is None:
            item = self._call_item(delta["id"], delta["function"]["name"], "", "in_progress")
            call = self._calls[delta["index"]] = _Call(item, len(self.output))
            self.output.append(item)
            events.append(
                self.event(
                    "response.output_item.added", output_index=call.output_index, item=dict(item)
                )
            )
        if arguments:
            call.item["arguments"] += arguments
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=call.item["id"],
                    output_index=call.output_index,
                    delta=arguments,
                )
            )
        return events


def _status(choice: Choice) -> str:
    return "incomplete" if choice.finish_reason == "length" else "completed"


def _format_of(text_format: Any) -> dict[str, Any]:
    if text_format is None:
        return {"type": "text"}
    fields = ("type", "name", "schema", "description", "strict")
    return {k: getattr(text_format, k) for k in fields if getattr(text_format, k) is not None}


def _usage(usage: dict[str, int]) -> dict[str, Any]:
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }
