"""Chat messages as the template gets them (`gateway/prompts.py`), with the embedded model's
tokenizer and chat template."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from pdserve.engine.embedded import embedded_model_path
from pdserve.gateway.offload import Offload
from pdserve.gateway.prompts import chat_prompt
from pdserve.text.tokenizer import Tokenizer

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip


@pytest.fixture(scope="module")
def offload() -> Iterator[Offload]:
    offload = Offload(Tokenizer.from_folder(embedded_model_path()))
    yield offload
    offload.close()


@pytest.mark.parametrize("content", [{"content": None}, {}], ids=["null", "absent"])
def test_an_assistant_turn_of_tool_calls_alone_renders_with_empty_content(
    offload: Offload, content: dict
) -> None:
    """What the OpenAI Agents SDK's chat model and LangChain send back after a tool call
    (`content` null or left out, as OpenAI's API allows): rendered as vLLM does, with ""
    for the text, where the template would otherwise fail on the missing key."""
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "tool_calls": [CALL], **content},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    prompt = asyncio.run(chat_prompt(messages, offload, max_model_len=1024))
    assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\nSunny, 21 C" in prompt.text
