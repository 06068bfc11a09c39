"""Chat messages in OpenAI's format that tests in several rooms write alike."""

from __future__ import annotations

from typing import Any


def assistant_tool_call(
    name: str, arguments: str | dict[str, Any], call_id: str | None = None
) -> dict[str, Any]:
    """An assistant turn with no text that calls function `name`: `arguments` a JSON string
    as OpenAI's API carries them, or a dict as chat templates take them; `call_id`, where
    given, the id the tool's answer names."""
    call: dict[str, Any] = {} if call_id is None else {"id": call_id}
    call.update(type="function", function={"name": name, "arguments": arguments})
    return {"role": "assistant", "content": "", "tool_calls": [call]}
