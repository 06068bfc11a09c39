"""Tool calls in a model's free text, as vLLM's `--tool-call-parser` names read them.

`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after any
content (Hermes, Qwen), a block holding one call or a list of them (SmolLM2).
`llama3_json`: the whole answer is `{"name": ..., "parameters": {...}}` objects separated
by `;`, optionally after `<|python_tag|>` (Llama 3.x). Text that does not parse as a call
stays content: a model that writes something call-like but broken
gets its words back rather than a half call.

For streaming, `content_prefix` says how much of the text so far is content for sure (it
can be sent), the rest being held back as a possible start of a call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text


class ToolParser(Protocol):
    name: str

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The finished text as (content or None, tool calls)."""
        ...

    def content_prefix(self, text: str) -> int:
        """How many leading characters of the unfinished text are content for sure."""
        ...


def _call_from(obj: Any, argument_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments: Any = {}
    for key in argument_keys:
        if key in obj:
            arguments = obj[key]
            break
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _held_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could begin `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class HermesParser:
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.OPEN)
        if start < 0:
            return text, []
        calls = []
        for body in self._BLOCK.findall(text[start:]):
            found = self._calls_in(body)
            if not found:
                return text, []
            calls.extend(found)
        content = text[:start].strip()
        return content or None, calls

    @staticmethod
    def _calls_in(body: str) -> list[ToolCall]:
        """One block's calls: an object, or a list of them (SmolLM2 writes a list); none
        if any of them is not a call."""
        try:
            value = json.loads(body.strip())
        except ValueError:
            return []
        found = [_call_from(v, ("arguments", "parameters")) for v in _as_list(value)]
        return [] if None in found else found  # type: ignore[return-value]

    def content_prefix(self, text: str) -> int:
        start = text.find(self.OPEN)
        if start >= 0:
            return start
        return len(text) - _held_suffix(text, self.OPEN)


class Llama3JsonParser:
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                obj, at = decoder.raw_decode(body, at)
            except ValueError:
                return text, []
            call = _call_from(obj, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
        return None, calls

    def content_prefix(self, text: str) -> int:
        head = text.lstrip()
        if not head or head.startswith("{") or head.startswith(self.TAG):
            return 0
        if self.TAG.startswith(head):
            return 0
        return len(text)


PARSERS: dict[str, type[HermesParser] | type[Llama3JsonParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
}
